// Byte-level BPE tokenizer for the HF `tokenizer.json` of the DeepSeek-V3/V4 family (docs/tokenizer.md).
//
// Pipeline of encode(text), as HF `tokenizers` runs it for this file:
//   1. added tokens: leftmost-longest match of every added token (special or not) on the raw text, honouring
//      lstrip / rstrip / single_word; a match becomes its id, the text between matches goes on;
//   2. normalizer (this file: an empty Sequence);
//   3. pre_tokenizer: Sequence of Split (PCRE2 regexes, UTF + UCP, JIT) then ByteLevel (bytes -> the GPT-2
//      printable alphabet; we keep raw bytes internally and map only in id_to_token / token_to_id);
//   4. BPE on each piece: merge-rank priority queue over a linked list of symbols (O(n log n)), results
//   cached
//      per piece in a sharded, mutex-protected map (encode is safe to call from many threads);
//   5. add_special_tokens: BOS / EOS from tokenizer_config.json (add_bos_token / add_eos_token), as HF
//      transformers' LlamaTokenizerFast does (the file's post_processor is ByteLevel, which adds nothing).
// decode(ids) follows the ByteLevel decoder: bytes of every token concatenated, then a lossy UTF-8 decode
// (invalid sequences -> U+FFFD, like Rust's String::from_utf8_lossy).
//
// Unsupported component types (normalizer, pre_tokenizer, model, decoder, post_processor) or options throw
// dsv4::Error at load naming the component type; invalid UTF-8 given to encode throws naming the byte offset.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

class Tokenizer {
 public:
  // `path` is a tokenizer.json or a directory holding one; tokenizer_config.json next to it, if present,
  // supplies bos/eos and add_bos_token/add_eos_token.
  static Tokenizer from_file(const std::string& path);
  // From the JSON texts themselves; `config_json` may be empty. `source` names the input in error messages.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json = {},
                             const std::string& source = "<memory>");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // Tokens in their tokenizer.json spelling (byte-level alphabet for vocab entries, e.g. "Ġthe").
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  // One past the largest id of the vocab and the added tokens.
  int32_t vocab_size() const;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  bool add_bos_token() const;
  bool add_eos_token() const;
  bool is_special(int32_t id) const;

  // The components of the loaded file, e.g. "normalizer=Sequence[] pre_tokenizer=Sequence[Split,...]".
  const std::string& describe() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Helpers shared with tests and the fuzz target.
// Offset of the first invalid UTF-8 byte, or npos when `text` is valid UTF-8 (no surrogates, no overlongs).
size_t find_invalid_utf8(std::string_view text);
// Lossy UTF-8 decode: each maximal invalid subpart becomes U+FFFD (WHATWG / Rust from_utf8_lossy).
std::string utf8_lossy(std::string_view bytes);

}  // namespace dsv4
