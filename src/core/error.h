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

}  // namespace dsv4

// Throws dsv4::Error(message) unless `condition` holds. A macro so that the message (string concatenations with
// the offending values) is only built on failure: checks sit on hot paths of the cache manager.
#define DSV4_CHECK(condition, message)                        \
  do {                                                        \
    if (!(condition)) throw ::dsv4::Error(message);           \
  } while (false)

namespace dsv4 {

}  // namespace dsv4
