// Errors carry the offending name and value in their message (docs/STYLE.md): bad input never aborts.
#pragma once
#include <stdexcept>
#include <string>

namespace dsv4 {

// Thrown for every input problem (malformed config, bad checkpoint, invalid arguments).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Throws Error(message) unless `condition` holds.
void check(bool condition, const std::string& message);

}  // namespace dsv4
