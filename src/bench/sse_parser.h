// Incremental parser of a text/event-stream body (the WHATWG "server-sent events" format), fed the bytes of the
// response body as the network delivers them: an event may be split anywhere, even inside a CRLF, so the parser
// keeps the unfinished line and the event being built between feeds.
//
// What it follows from the spec: lines end in CRLF, LF or CR; a blank line dispatches the event; "data" lines
// are joined with LF; one space after the colon is dropped; lines starting with ':' are comments; a field line
// without a colon is a field with an empty value; a UTF-8 BOM opening the stream is skipped; an event left
// unfinished when the stream ends is discarded (the caller simply never sees it).
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4::bench {

struct SseEvent {
  std::string type;  // the "event:" field; empty means the default type, "message"
  std::string data;  // the "data:" lines joined with '\n'
  std::string id;    // the last "id:" field seen (it persists across events, as the spec says)

  bool operator==(const SseEvent&) const = default;
};

class SseParser {
 public:
  // A line or an event larger than `max_event_bytes` throws dsv4::Error: a server that never sends a newline
  // must not grow the client's memory without bound.
  explicit SseParser(size_t max_event_bytes = size_t{16} << 20);

  // Parses `bytes`; appends every event they complete to `events`.
  void feed(std::string_view bytes, std::vector<SseEvent>& events);

 private:
  void process_line(std::string_view line, std::vector<SseEvent>& events);

  size_t max_event_bytes_;
  std::string line_;             // the current line, not yet terminated
  bool after_cr_ = false;        // the last byte was CR: a following LF belongs to the same line ending
  bool at_stream_start_ = true;  // no line has been completed yet (a BOM may open the first one)
  std::string data_;             // data lines of the pending event, each followed by '\n'
  std::string type_;
  std::string last_id_;
};

}  // namespace dsv4::bench
