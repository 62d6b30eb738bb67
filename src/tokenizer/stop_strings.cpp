#include "tokenizer/stop_strings.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stop_strings) : stops_(std::move(stop_strings)) {
  for (const auto& stop : stops_) {
    DSV4_CHECK(!stop.empty(), "stop: empty stop strings are not allowed");
    longest_ = std::max(longest_, stop.size());
  }
}

std::string StopStringMatcher::push(std::string_view text) {
  if (stopped_) return {};
  pending_.append(text);
  // The earliest occurrence of any stop string ends the stream.
  size_t first = std::string::npos;
  for (const auto& stop : stops_) {
    const size_t at = pending_.find(stop);
    if (at < first) first = at, matched_ = stop;
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first);
    pending_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& stop : stops_)
    for (size_t n = std::min(stop.size() - 1, pending_.size()); n > hold; --n)
      if (pending_.compare(pending_.size() - n, n, stop, 0, n) == 0) {
        hold = n;
        break;
      }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopStringMatcher::flush() {
  std::string out;
  out.swap(pending_);
  return stopped_ ? std::string() : out;
}

}  // namespace dsv4
