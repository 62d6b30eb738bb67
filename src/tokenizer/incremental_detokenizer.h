// Streaming detokenizer: feed token ids one at a time, get back the text that became final
// (docs/tokenizer.md).
//
// Each token's bytes (the ByteLevel decoder: a token spelled only in the GPT-2 byte alphabet is those bytes,
// any other token, i.e. an added token, is its own UTF-8) go into a pending buffer. push() returns the
// buffer's longest prefix that does not end inside an incomplete but still possibly valid UTF-8 sequence,
// lossy-decoded (invalid bytes -> U+FFFD exactly as Tokenizer::decode does), and keeps the 0-3 trailing bytes
// of the incomplete code point. flush() returns whatever is left (an unfinished sequence becomes U+FFFD).
// So the concatenation of every push() and the final flush() equals tok.decode(ids, skip_special_tokens),
// and every piece is valid UTF-8.
#pragma once
#include <cstdint>
#include <string>

#include "tokenizer/tokenizer.h"

namespace dsv4 {

class IncrementalDetokenizer {
 public:
  // `tokenizer` must outlive this object.
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens = false);

  // Appends token `id`; returns the newly final text (possibly empty). Throws dsv4::Error naming the id
  // when it is not a token of the tokenizer.
  std::string push(int32_t id);
  // Returns the held-back bytes, lossy-decoded, and resets the pending state.
  std::string flush();
  // Number of bytes held back for an incomplete code point (0-3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

// Length (0-3) of the trailing bytes of `bytes` that are a proper prefix of a valid UTF-8 sequence (a lead
// byte followed by fewer continuation bytes than it needs, each in its allowed range).
size_t incomplete_utf8_tail(std::string_view bytes);

}  // namespace dsv4
