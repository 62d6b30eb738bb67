// tokenizer_check TOKENIZER REFERENCE.jsonl: encodes every {"text", "ids"} line of a reference file (written
// by tools/tokenizer/make_reference.mjs), counts the lines whose ids differ and the lines where
// decode(encode(text)) != text, and prints the single-threaded encode throughput. Exit 0 only with no
// mismatch. Used by the live ctest (tests/tokenizer/live_reference.sh) and to measure MB/s beside the JS
// reference.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON_OR_DIR REFERENCE.jsonl\n", argv[0]);
    return 2;
  }
  try {
    const auto load_begin = std::chrono::steady_clock::now();
    const dsv4::Tokenizer tokenizer = dsv4::Tokenizer::from_file(argv[1]);
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - load_begin).count();
    std::ifstream in(argv[2]);
    if (!in) {
      std::fprintf(stderr, "cannot open %s\n", argv[2]);
      return 2;
    }
    std::vector<std::string> texts;
    std::vector<std::vector<int32_t>> expected;
    size_t bytes = 0;
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      const nlohmann::json j = nlohmann::json::parse(line);
      texts.push_back(j.at("text").get<std::string>());
      expected.push_back(j.at("ids").get<std::vector<int32_t>>());
      bytes += texts.back().size();
    }
    size_t id_mismatches = 0, round_trip_mismatches = 0;
    std::vector<std::vector<int32_t>> got(texts.size());
    const auto pass = [&] {
      const auto begin = std::chrono::steady_clock::now();
      for (size_t i = 0; i < texts.size(); ++i) got[i] = tokenizer.encode(texts[i]);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    };
    const double cold = pass();
    const double warm = pass();
    for (size_t i = 0; i < texts.size(); ++i) {
      if (got[i] != expected[i]) {
        if (id_mismatches++ < 5) {
          std::fprintf(stderr, "mismatch line %zu: %s\n  want", i + 1,
                       nlohmann::json(texts[i]).dump().c_str());
          for (const int32_t id : expected[i]) std::fprintf(stderr, " %d", id);
          std::fprintf(stderr, "\n  got ");
          for (const int32_t id : got[i]) std::fprintf(stderr, " %d", id);
          std::fprintf(stderr, "\n");
        }
      }
      if (tokenizer.decode(got[i]) != texts[i]) ++round_trip_mismatches;
    }
    std::printf(
        "cpp: %zu lines, %zu bytes; load %.2f s; encode %.2f MB/s (first pass), %.2f MB/s (second pass); "
        "id mismatches %zu, round-trip mismatches %zu\n",
        texts.size(), bytes, load_s, bytes / 1e6 / cold, bytes / 1e6 / warm, id_mismatches,
        round_trip_mismatches);
    return id_mismatches == 0 && round_trip_mismatches == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
