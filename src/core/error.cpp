#include "core/error.h"

namespace dsv4 {

void check(bool condition, const std::string& message) {
  if (!condition) throw Error(message);
}

}  // namespace dsv4
