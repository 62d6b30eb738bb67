#include "bench/sse_parser.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4::bench {

namespace {
constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";
}

SseParser::SseParser(size_t max_event_bytes) : max_event_bytes_(max_event_bytes) {}

void SseParser::feed(std::string_view bytes, std::vector<SseEvent>& events) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    if (after_cr_) {
      after_cr_ = false;
      if (bytes[pos] == '\n') {  // the LF of a CRLF whose CR ended the previous feed
        ++pos;
        continue;
      }
    }
    const size_t end = bytes.find_first_of("\r\n", pos);
    const size_t stop = end == std::string_view::npos ? bytes.size() : end;
    DSV4_CHECK(line_.size() + (stop - pos) + data_.size() <= max_event_bytes_,
               "SSE event larger than " + std::to_string(max_event_bytes_) + " bytes");
    if (end == std::string_view::npos) {
      line_.append(bytes.substr(pos));
      return;
    }
    std::string_view line = bytes.substr(pos, end - pos);
    if (!line_.empty()) {  // the line began in an earlier feed
      line_.append(line);
      line = line_;
    }
    after_cr_ = bytes[end] == '\r';
    pos = end + 1;
    process_line(line, events);
    line_.clear();
  }
}

void SseParser::process_line(std::string_view line, std::vector<SseEvent>& events) {
  if (at_stream_start_) {
    at_stream_start_ = false;
    if (line.starts_with(kUtf8Bom)) line.remove_prefix(kUtf8Bom.size());
  }
  if (line.empty()) {
    // Dispatch. An event with no data lines is dropped, but its "event:" type is reset all the same.
    if (!data_.empty()) {
      data_.pop_back();  // the '\n' after the last data line
      events.push_back(SseEvent{std::move(type_), std::move(data_), last_id_});
    }
    data_.clear();
    type_.clear();
    return;
  }
  if (line.front() == ':') return;  // a comment (servers send these as keep-alives)
  const size_t colon = line.find(':');
  const std::string_view field = line.substr(0, colon);
  std::string_view value = colon == std::string_view::npos ? std::string_view{} : line.substr(colon + 1);
  if (value.starts_with(' ')) value.remove_prefix(1);
  if (field == "data") {
    data_.append(value);
    data_.push_back('\n');
  } else if (field == "event") {
    type_.assign(value);
  } else if (field == "id") {
    if (value.find('\0') == std::string_view::npos) last_id_.assign(value);
  }
  // "retry" and unknown fields carry nothing a benchmark client uses.
}

}  // namespace dsv4::bench
