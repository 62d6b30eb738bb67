#include "tokenizer/incremental_detokenizer.h"

#include <array>
#include <optional>
#include <string_view>

#include "core/error.h"

namespace dsv4 {
namespace {

// The inverse of GPT-2's bytes_to_unicode: printable code point -> byte, -1 for code points outside it.
// Bytes 33-126, 161-172 and 174-255 stand for themselves; the other 68 bytes map to 256, 257, ... in order.
const std::array<int16_t, 324>& unicode_to_byte() {
  static const std::array<int16_t, 324> table = [] {
    std::array<int16_t, 324> t{};
    t.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      t[printable ? b : next++] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return table;
}

// Decodes `token` (valid UTF-8) through the byte alphabet; nullopt if any code point is outside it.
std::optional<std::string> byte_level_bytes(std::string_view token) {
  const auto& table = unicode_to_byte();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const auto c = static_cast<unsigned char>(token[i]);
    uint32_t cp = 0;
    size_t len = 1;
    if (c < 0x80) {
      cp = c;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < token.size()) {
      cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(token[i + 1]) & 0x3Fu);
      len = 2;
    } else {
      return std::nullopt;  // three- and four-byte code points are all above 0x143
    }
    if (cp >= table.size() || table[cp] < 0) return std::nullopt;
    out.push_back(static_cast<char>(table[cp]));
    i += len;
  }
  return out;
}

}  // namespace

size_t incomplete_utf8_tail(std::string_view bytes) {
  const size_t n = bytes.size();
  for (size_t k = 1; k <= 3 && k <= n; ++k) {
    const auto lead = static_cast<unsigned char>(bytes[n - k]);
    if ((lead & 0xC0) == 0x80) continue;  // continuation byte: look further back
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
    if (lead >= 0xC2 && lead <= 0xDF) {
      need = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      need = 3;
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      need = 4;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    } else {
      return 0;  // ASCII or a byte that never starts a sequence
    }
    if (k >= need) return 0;  // complete (or over-long run of continuations): nothing to hold
    for (size_t j = 1; j < k; ++j) {
      const auto cont = static_cast<unsigned char>(bytes[n - k + j]);
      const bool ok = j == 1 ? (cont >= lo && cont <= hi) : ((cont & 0xC0) == 0x80);
      if (!ok) return 0;
    }
    return k;
  }
  return 0;
}

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(int32_t id) {
  const std::optional<std::string> token = tokenizer_->id_to_token(id);
  if (!token)
    throw Error("incremental_detokenizer: id " + std::to_string(id) + " is not a token (vocab_size " +
                std::to_string(tokenizer_->vocab_size()) + ")");
  if (skip_special_tokens_ && tokenizer_->is_special(id)) return {};
  pending_ += byte_level_bytes(*token).value_or(*token);
  const size_t hold = incomplete_utf8_tail(pending_);
  const size_t ready = pending_.size() - hold;
  if (ready == 0) return {};
  std::string out = utf8_lossy(std::string_view(pending_).substr(0, ready));
  pending_.erase(0, ready);
  return out;
}

std::string IncrementalDetokenizer::flush() {
  std::string out = utf8_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace dsv4
