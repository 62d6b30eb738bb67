// Tokenizer tests: exact ids against the JS reference fixture (tests/fixtures/tokenizer/reference.jsonl, made
// by tools/tokenizer/make_reference.mjs), decode(encode(x)) == x on all of it, the API around it, and
// load-time errors on a small synthetic tokenizer.json. The DeepSeek tokenizer.json comes from the npm
// package that scripts/setup.sh installs; without it the tests that need it skip.
#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "tokenizer/tokenize_command.h"

#include "deepseek_tokenizer.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;

using testing::deepseek;
using testing::kDeepSeekDir;
using testing::kReference;

struct ReferenceLine {
  std::string text;
  std::vector<int32_t> ids;
};

const std::vector<ReferenceLine>& reference() {
  static const std::vector<ReferenceLine> lines = [] {
    std::vector<ReferenceLine> out;
    std::ifstream in(kReference);
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      const json j = json::parse(line);
      out.push_back({j.at("text").get<std::string>(), j.at("ids").get<std::vector<int32_t>>()});
    }
    return out;
  }();
  return lines;
}

TEST(TokenizerDeepSeek, MatchesJsReferenceOnEveryLine) {
  REQUIRE_DEEPSEEK();
  const auto& lines = reference();
  ASSERT_GE(lines.size(), 10000u) << kReference;
  size_t mismatches = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::vector<int32_t> ids = tok->encode(lines[i].text);
    if (ids != lines[i].ids && ++mismatches <= 5)
      ADD_FAILURE() << "line " << i + 1 << ": " << json(lines[i].text).dump() << "\n  want "
                    << json(lines[i].ids) << "\n  got  " << json(ids);
  }
  EXPECT_EQ(mismatches, 0u) << "of " << lines.size() << " lines";
}

TEST(TokenizerDeepSeek, DecodeInvertsEncodeOnEveryLine) {
  REQUIRE_DEEPSEEK();
  size_t mismatches = 0;
  for (const ReferenceLine& line : reference()) {
    const std::string back = tok->decode(tok->encode(line.text));
    if (back != line.text && ++mismatches <= 5)
      ADD_FAILURE() << json(line.text).dump() << " -> " << json(back).dump();
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(TokenizerDeepSeek, ConcurrentEncodesAgree) {
  REQUIRE_DEEPSEEK();
  const auto& lines = reference();
  std::vector<size_t> failures(8, 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < failures.size(); ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < lines.size(); i += 3)
        if (tok->encode(lines[i].text) != lines[i].ids) ++failures[t];
    });
  }
  for (auto& thread : threads) thread.join();
  for (size_t t = 0; t < failures.size(); ++t) EXPECT_EQ(failures[t], 0u) << "thread " << t;
}

TEST(TokenizerDeepSeek, ComponentsSpecialTokensAndConfig) {
  REQUIRE_DEEPSEEK();
  EXPECT_NE(tok->describe().find("pre_tokenizer=Sequence[Split"), std::string::npos) << tok->describe();
  EXPECT_EQ(tok->vocab_size(), 128815);
  EXPECT_EQ(tok->bos_id(), 0);
  EXPECT_EQ(tok->eos_id(), 1);
  EXPECT_TRUE(tok->add_bos_token());
  EXPECT_FALSE(tok->add_eos_token());
  EXPECT_EQ(tok->token_to_id("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_EQ(tok->token_to_id("<｜User｜>"), 128803);
  EXPECT_EQ(tok->id_to_token(128803), "<｜User｜>");
  EXPECT_FALSE(tok->id_to_token(128815).has_value());
  EXPECT_FALSE(tok->token_to_id("no such token").has_value());
  // Vocab tokens are spelled in the byte alphabet: " the" is "Ġthe".
  const auto the = tok->token_to_id("Ġthe");
  ASSERT_TRUE(the.has_value());
  EXPECT_EQ(tok->encode(" the"), std::vector<int32_t>{*the});
  EXPECT_EQ(tok->id_to_token(*the), "Ġthe");

  // Added tokens are matched before pre-tokenization, longest first; a prefix of one is plain text.
  const std::vector<int32_t> ids = tok->encode("<｜User｜>hi<｜Assistant｜><｜end▁of▁sentence｜>");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids.front(), 128803);
  EXPECT_EQ(ids[ids.size() - 2], 128804);
  EXPECT_EQ(ids.back(), 1);
  for (const int32_t id : tok->encode("<｜User")) EXPECT_LT(id, 128000);

  // add_special_tokens prepends BOS (add_bos_token in tokenizer_config.json), as HF's LlamaTokenizerFast
  // does.
  const std::vector<int32_t> plain = tok->encode("Hello"), with_bos = tok->encode("Hello", true);
  ASSERT_EQ(with_bos.size(), plain.size() + 1);
  EXPECT_EQ(with_bos[0], 0);

  EXPECT_EQ(tok->decode(with_bos), "<｜begin▁of▁sentence｜>Hello");
  EXPECT_EQ(tok->decode(with_bos, /*skip_special_tokens=*/true), "Hello");
  // Non-special added tokens survive skip_special_tokens.
  EXPECT_EQ(tok->decode(tok->encode("<｜User｜>x"), true), "<｜User｜>x");
  EXPECT_TRUE(tok->is_special(0));
  EXPECT_FALSE(tok->is_special(128803));
}

TEST(TokenizerDeepSeek, InvalidInputIsAnError) {
  REQUIRE_DEEPSEEK();
  try {
    tok->encode("ok\xC3(");
    FAIL() << "no error on invalid UTF-8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("byte offset 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(tok->encode("\xED\xA0\x80"), Error);  // a surrogate
  EXPECT_THROW(tok->encode("\xC0\xAF"), Error);      // overlong
  const std::vector<int32_t> bad = {5, 200000};
  EXPECT_THROW(tok->decode(bad), Error);
  const std::vector<int32_t> negative = {-1};
  EXPECT_THROW(tok->decode(negative), Error);
  // A partial UTF-8 sequence decodes lossily to U+FFFD.
  const auto lead = tok->token_to_id("ä");  // byte 0xE4 in the byte alphabet
  ASSERT_TRUE(lead.has_value());
  EXPECT_EQ(tok->decode(std::vector<int32_t>{*lead}), "\xEF\xBF\xBD");
}

TEST(TokenizerDeepSeek, LongAndRepetitiveInputs) {
  REQUIRE_DEEPSEEK();
  for (const std::string& text : {std::string(100000, ' '), std::string(50000, 'a'), std::string(30000, '7'),
                                  std::string(20000, '\n') + "x", std::string(3000, '!')}) {
    const std::vector<int32_t> ids = tok->encode(text);
    EXPECT_EQ(tok->decode(ids), text) << text.size() << " bytes of '" << text[0] << "'";
  }
}

// ------------------------------------------------------------------------------------ synthetic
// tokenizer.json

// 256 byte tokens, merges "a b" -> "ab" and "ab c" -> "abc", one added token; a Split on \s+ then ByteLevel.
json tiny_tokenizer() {
  // Byte alphabet: printable bytes map to themselves, the rest to U+0100 + n (in byte order).
  json vocab = json::object();
  int extra = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    const int cp = printable ? b : extra++;
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    vocab[s] = b;
  }
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  json j = {{"version", "1.0"},
            {"added_tokens", json::array({{{"id", 258},
                                           {"content", "<x>"},
                                           {"special", true},
                                           {"normalized", false},
                                           {"lstrip", false},
                                           {"rstrip", false},
                                           {"single_word", false}}})},
            {"normalizer", nullptr},
            {"pre_tokenizer",
             {{"type", "Sequence"},
              {"pretokenizers",
               json::array({{{"type", "Split"},
                             {"pattern", {{"Regex", "\\s+"}}},
                             {"behavior", "Isolated"},
                             {"invert", false}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}},
            {"post_processor", nullptr},
            {"decoder", {{"type", "ByteLevel"}}},
            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"a b", "ab c"})}}}};
  return j;
}

Tokenizer load(const json& j) { return Tokenizer::from_json(j.dump()); }

TEST(TokenizerTiny, MergesByRankAndSplits) {
  const Tokenizer tok = load(tiny_tokenizer());
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{257}));
  EXPECT_EQ(tok.encode("abab"), (std::vector<int32_t>{256, 256}));
  EXPECT_EQ(tok.encode("ab c"), (std::vector<int32_t>{256, ' ', 'c'}));  // the Split keeps "ab" and "c" apart
  EXPECT_EQ(tok.encode("<x>abc<x>"), (std::vector<int32_t>{258, 257, 258}));
  EXPECT_EQ(tok.vocab_size(), 259);
  EXPECT_FALSE(tok.bos_id().has_value());
  EXPECT_EQ(tok.encode("abc", true), (std::vector<int32_t>{257}));  // no tokenizer_config: nothing added
}

// \s follows Unicode White_Space as HF tokenizers (Oniguruma) does: U+0085 is a space, U+FEFF is not.
TEST(TokenizerTiny, WhiteSpaceClassIsUnicodeWhiteSpace) {
  json j = tiny_tokenizer();
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
  const Tokenizer tok = load(j);
  EXPECT_EQ(tok.encode("a\u0085b"), (std::vector<int32_t>{'a', 'b'}));
  EXPECT_EQ(tok.encode("a\u3000\u2028b"), (std::vector<int32_t>{'a', 'b'}));
  EXPECT_EQ(tok.encode("a\uFEFFb"), (std::vector<int32_t>{'a', 0xEF, 0xBB, 0xBF, 'b'}));
}

TEST(TokenizerTiny, AddedTokenStripFlags) {
  json j = tiny_tokenizer();
  j["added_tokens"][0]["lstrip"] = true;
  j["added_tokens"][0]["rstrip"] = true;
  const Tokenizer tok = load(j);
  EXPECT_EQ(tok.encode("ab  <x>\t c"), (std::vector<int32_t>{256, 258, 'c'}));
  json w = tiny_tokenizer();
  w["added_tokens"][0]["single_word"] = true;
  const Tokenizer single = load(w);
  EXPECT_EQ(single.encode("a<x>"), (std::vector<int32_t>{'a', '<', 'x', '>'}));
  EXPECT_EQ(single.encode("a <x>"), (std::vector<int32_t>{'a', ' ', 258}));
}

TEST(TokenizerTiny, ConfigSuppliesBosAndEos) {
  const json config = {{"add_bos_token", true},
                       {"add_eos_token", true},
                       {"bos_token", "<x>"},
                       {"eos_token", {{"content", "<x>"}}}};
  const Tokenizer tok = Tokenizer::from_json(tiny_tokenizer().dump(), config.dump());
  EXPECT_EQ(tok.encode("abc", true), (std::vector<int32_t>{258, 257, 258}));
  const json bad = {{"bos_token", "<nope>"}};
  EXPECT_THROW(Tokenizer::from_json(tiny_tokenizer().dump(), bad.dump()), Error);
}

// Every unsupported component fails at load, naming its type.
TEST(TokenizerTiny, UnsupportedComponentsNameTheirType) {
  const auto expect_error = [](json j, const std::string& needle) {
    try {
      load(j);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  json j = tiny_tokenizer();
  j["normalizer"] = {{"type", "NFKC"}};
  expect_error(j, "NFKC");
  j = tiny_tokenizer();
  j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Metaspace"}};
  expect_error(j, "Metaspace");
  j = tiny_tokenizer();
  j["model"]["type"] = "WordPiece";
  expect_error(j, "WordPiece");
  j = tiny_tokenizer();
  j["decoder"] = {{"type", "WordPiece"}};
  expect_error(j, "WordPiece");
  j = tiny_tokenizer();
  j["post_processor"] = {{"type", "TemplateProcessing"}};
  expect_error(j, "TemplateProcessing");
  j = tiny_tokenizer();
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  expect_error(j, "Sideways");
  j = tiny_tokenizer();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(unclosed"}};
  expect_error(j, "(unclosed");
  j = tiny_tokenizer();
  j["model"]["merges"].push_back("q zz");
  expect_error(j, "q zz");
  j = tiny_tokenizer();
  j["model"]["byte_fallback"] = true;
  expect_error(j, "byte_fallback");
  expect_error(json::array(), "not a JSON object");
  EXPECT_THROW(Tokenizer::from_json("{not json"), Error);
  EXPECT_THROW(Tokenizer::from_file("/nonexistent/dir"), Error);
}

TEST(TokenizerTiny, SplitBehaviors) {
  const auto pieces_of = [](const std::string& behavior, bool invert, const std::string& text) {
    json j = tiny_tokenizer();
    // Pattern "b": with merges a+b, the pieces decide whether "ab" can form.
    j["pre_tokenizer"]["pretokenizers"][0] = {
        {"type", "Split"}, {"pattern", {{"String", "b"}}}, {"behavior", behavior}, {"invert", invert}};
    return load(j).encode(text);
  };
  EXPECT_EQ(pieces_of("Isolated", false, "abc"), (std::vector<int32_t>{'a', 'b', 'c'}));
  EXPECT_EQ(pieces_of("Removed", false, "abc"), (std::vector<int32_t>{'a', 'c'}));
  EXPECT_EQ(pieces_of("MergedWithPrevious", false, "abc"), (std::vector<int32_t>{256, 'c'}));
  EXPECT_EQ(pieces_of("MergedWithNext", false, "abc"), (std::vector<int32_t>{'a', 'b', 'c'}));
  EXPECT_EQ(pieces_of("Contiguous", false, "abbc"), (std::vector<int32_t>{'a', 'b', 'b', 'c'}));
  EXPECT_EQ(pieces_of("Removed", true, "abc"), (std::vector<int32_t>{'b'}));
}

TEST(TokenizerUtf8, LossyDecodeReplacesMaximalSubparts) {
  EXPECT_EQ(utf8_lossy("a\xF0\x9F\x98"), "a\xEF\xBF\xBD");        // truncated 4-byte: one U+FFFD
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong: two
  EXPECT_EQ(utf8_lossy("\xE4\xB8\xAD\xFF"), "\xE4\xB8\xAD\xEF\xBF\xBD");
  EXPECT_EQ(find_invalid_utf8("héllo"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("h\x80"), 1u);
}

TEST(TokenizeCommand, TokenizeThenDetokenizeRoundTrips) {
  REQUIRE_DEEPSEEK();
  const std::string path = ::testing::TempDir() + "/tokenize_command_input.txt";
  const std::string text = "Hello 世界\n<｜User｜>12345";
  std::ofstream(path, std::ios::binary) << text;
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(tokenize_command(kDeepSeekDir, path, /*add_bos=*/true), 0);
  std::fflush(stdout);
  const std::string ids = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(ids.rfind("[0,", 0), 0u) << ids;  // one JSON array, BOS first
  std::vector<int32_t> want = tok->encode(text);
  want.insert(want.begin(), 0);
  EXPECT_EQ(parse_token_ids(ids), want);
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(detokenize_command(kDeepSeekDir, ids), 0);
  std::fflush(stdout);
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "<｜begin▁of▁sentence｜>" + text);
  EXPECT_THROW(tokenize_command(kDeepSeekDir, path + ".missing", false), Error);
  EXPECT_THROW(detokenize_command(kDeepSeekDir, "1,2,999999"), Error);
}

TEST(TokenizeCommand, ParsesIdLists) {
  EXPECT_EQ(parse_token_ids("5,17, 3\n4"), (std::vector<int32_t>{5, 17, 3, 4}));
  EXPECT_EQ(parse_token_ids("[5, 17]"), (std::vector<int32_t>{5, 17}));
  EXPECT_TRUE(parse_token_ids("").empty());
  EXPECT_THROW(parse_token_ids("5,x"), Error);
  EXPECT_THROW(parse_token_ids("-3"), Error);
  EXPECT_THROW(parse_token_ids("99999999999"), Error);
}

}  // namespace
}  // namespace dsv4
