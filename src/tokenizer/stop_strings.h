// Stop strings over streamed text (OpenAI `stop`, vLLM semantics): a stop string may span token boundaries,
// is not emitted, and nothing after it is. Text that could still be the start of a stop string is held back
// until it is decided.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stop_strings);

  // Appends newly decoded text; returns the text that is now safe to emit. After a match, stopped() is true,
  // the returned text ends just before the stop string, and later calls return nothing.
  std::string push(std::string_view text);
  // End of the stream without a match: the held-back text.
  std::string flush();
  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  size_t longest_ = 0;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace dsv4
