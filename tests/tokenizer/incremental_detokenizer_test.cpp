// IncrementalDetokenizer: on every line of tests/fixtures/tokenizer/reference.jsonl (real DeepSeek tokenizer,
// skipped when absent), the pieces concatenate to decode(all ids) and each piece is valid UTF-8; plus the
// UTF-8 tail rule on hand-made byte strings and a small synthetic byte-level tokenizer.
#include "tokenizer/incremental_detokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"

#include "deepseek_tokenizer.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;

using testing::deepseek;
using testing::kDeepSeekDir;
using testing::kReference;

std::vector<std::vector<int32_t>> reference_ids() {
  std::vector<std::vector<int32_t>> out;
  std::ifstream in(kReference);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    out.push_back(json::parse(line).at("ids").get<std::vector<int32_t>>());
  }
  return out;
}

// Streams `ids`, checking every piece; returns the concatenation.
std::string stream(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special, size_t* bad) {
  IncrementalDetokenizer detok(tok, skip_special);
  std::string all;
  for (const int32_t id : ids) {
    const std::string piece = detok.push(id);
    if (find_invalid_utf8(piece) != std::string::npos) ++*bad;
    EXPECT_LE(detok.pending_bytes(), 3u);
    all += piece;
  }
  const std::string tail = detok.flush();
  if (find_invalid_utf8(tail) != std::string::npos) ++*bad;
  EXPECT_EQ(detok.pending_bytes(), 0u);
  return all + tail;
}

TEST(IncrementalDetokenizerDeepSeek, PiecesConcatenateToDecodeOnEveryReferenceLine) {
  REQUIRE_DEEPSEEK();
  const auto lines = reference_ids();
  ASSERT_GE(lines.size(), 10000u) << kReference;
  size_t mismatches = 0, bad_pieces = 0, held = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string streamed = stream(*tok, lines[i], false, &bad_pieces);
    if (streamed != tok->decode(lines[i]) && ++mismatches <= 5)
      ADD_FAILURE() << "line " << i + 1 << ": "
                    << json(streamed).dump(-1, ' ', false, json::error_handler_t::replace);
    // Count lines where some token ends mid code point, to show the hold-back path is exercised.
    IncrementalDetokenizer d(*tok);
    for (const int32_t id : lines[i]) {
      d.push(id);
      if (d.pending_bytes() > 0) {
        ++held;
        break;
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << lines.size() << " lines";
  EXPECT_EQ(bad_pieces, 0u);
  EXPECT_GT(held, 0u) << "no reference line splits a code point across tokens";
}

TEST(IncrementalDetokenizerDeepSeek, SpecialTokensEmittedOrSkipped) {
  REQUIRE_DEEPSEEK();
  const std::vector<int32_t> ids = tok->encode("<｜User｜>héllo 世界<｜end▁of▁sentence｜>", true);
  ASSERT_EQ(ids.front(), *tok->bos_id());
  size_t bad = 0;
  EXPECT_EQ(stream(*tok, ids, false, &bad), tok->decode(ids, false));
  EXPECT_EQ(stream(*tok, ids, true, &bad), tok->decode(ids, true));
  EXPECT_EQ(stream(*tok, ids, true, &bad), "<｜User｜>héllo 世界");  // <｜User｜> is not special
  EXPECT_EQ(bad, 0u);
}

TEST(IncrementalDetokenizerDeepSeek, SplitCharacterIsHeldBack) {
  REQUIRE_DEEPSEEK();
  // A rare CJK character / emoji is split into byte tokens by byte-level BPE.
  const std::string text = "a😀b";
  const std::vector<int32_t> ids = tok->encode(text);
  IncrementalDetokenizer detok(*tok);
  std::string all;
  for (const int32_t id : ids) {
    const std::string piece = detok.push(id);
    EXPECT_EQ(find_invalid_utf8(piece), std::string::npos);
    all += piece;
  }
  all += detok.flush();
  EXPECT_EQ(all, text);
}

TEST(IncrementalDetokenizerDeepSeek, UnknownIdThrows) {
  REQUIRE_DEEPSEEK();
  IncrementalDetokenizer detok(*tok);
  EXPECT_THROW(detok.push(tok->vocab_size()), Error);
  EXPECT_THROW(detok.push(-1), Error);
}

TEST(IncrementalDetokenizer, IncompleteTailRule) {
  EXPECT_EQ(incomplete_utf8_tail(""), 0u);
  EXPECT_EQ(incomplete_utf8_tail("abc"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("a\xC3"), 1u);
  EXPECT_EQ(incomplete_utf8_tail("a\xC3\xA9"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("\xE4\xB8"), 2u);
  EXPECT_EQ(incomplete_utf8_tail("\xE4\xB8\x96"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(incomplete_utf8_tail("\xF0\x9F\x98\x80"), 0u);
  EXPECT_EQ(incomplete_utf8_tail("\xE0\x80"), 0u);  // overlong: never valid, emit as U+FFFD now
  EXPECT_EQ(incomplete_utf8_tail("\xED\xA0"), 0u);  // surrogate
  EXPECT_EQ(incomplete_utf8_tail("\xF4\x90"), 0u);  // above U+10FFFF
  EXPECT_EQ(incomplete_utf8_tail("\xC0"), 0u);      // never a lead byte
  EXPECT_EQ(incomplete_utf8_tail("\x80\x80"), 0u);  // stray continuations
  EXPECT_EQ(incomplete_utf8_tail("\xE4\x41"), 0u);
}

// A tiny byte-level tokenizer: id b is the single byte b (spelled in the GPT-2 byte alphabet), no merges,
// and one special token <s> with id 256.
Tokenizer tiny() {
  json vocab = json::object();
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const int cp = printable ? b : next++;
    std::string spelled;
    if (cp < 0x80) {
      spelled.push_back(static_cast<char>(cp));
    } else {
      spelled.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      spelled.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[spelled] = b;
  }
  const json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  const json tj = {{"version", "1.0"},
                   {"added_tokens", json::array({{{"id", 256},
                                                  {"content", "<s>"},
                                                  {"special", true},
                                                  {"single_word", false},
                                                  {"lstrip", false},
                                                  {"rstrip", false},
                                                  {"normalized", false}}})},
                   {"normalizer", nullptr},
                   {"pre_tokenizer", byte_level},
                   {"post_processor", nullptr},
                   {"decoder", byte_level},
                   {"model",
                    {{"type", "BPE"},
                     {"dropout", nullptr},
                     {"unk_token", nullptr},
                     {"continuing_subword_prefix", nullptr},
                     {"end_of_word_suffix", nullptr},
                     {"fuse_unk", false},
                     {"byte_fallback", false},
                     {"vocab", vocab},
                     {"merges", json::array()}}}};
  return Tokenizer::from_json(tj.dump());
}

TEST(IncrementalDetokenizer, SyntheticByteTokens) {
  const Tokenizer tok = tiny();
  IncrementalDetokenizer detok(tok);
  EXPECT_EQ(detok.push('a'), "a");
  EXPECT_EQ(detok.push(0xC3), "");  // first byte of é
  EXPECT_EQ(detok.pending_bytes(), 1u);
  EXPECT_EQ(detok.push(0xA9), "é");
  EXPECT_EQ(detok.push(0xE4), "");  // 世 = E4 B8 96, one byte per token
  EXPECT_EQ(detok.push(0xB8), "");
  EXPECT_EQ(detok.pending_bytes(), 2u);
  EXPECT_EQ(detok.push(0x96), "世");
  EXPECT_EQ(detok.push(256), "<s>");
  EXPECT_EQ(detok.push(0xC3), "");
  EXPECT_EQ(detok.push('a'),
            "\xEF\xBF\xBD"
            "a");  // 0xC3 then 'a': invalid, U+FFFD then a
  EXPECT_EQ(detok.push(0xE4), "");
  EXPECT_EQ(detok.flush(), "\xEF\xBF\xBD");     // unfinished at the end
  EXPECT_EQ(detok.push(0xFF), "\xEF\xBF\xBD");  // never valid: emitted at once
  IncrementalDetokenizer skipping(tok, true);
  EXPECT_EQ(skipping.push(256), "");
  EXPECT_EQ(skipping.push(' '), " ");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{'a', 0xC3, 0xA9, 256}), "aé<s>");
}

}  // namespace
}  // namespace dsv4
