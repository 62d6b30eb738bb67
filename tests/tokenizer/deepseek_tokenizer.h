// The real DeepSeek tokenizer for the tokenizer tests (scripts/setup.sh installs it under DSV4_TOKENIZER_DIR),
// loaded once per test binary; tests skip cleanly when it is absent.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "tokenizer/tokenizer.h"

namespace dsv4::testing {

inline const std::string kDeepSeekDir = DSV4_TOKENIZER_DIR;
inline const std::string kReference = std::string(DSV4_FIXTURES) + "/tokenizer/reference.jsonl";

inline const Tokenizer* deepseek() {
  static const std::unique_ptr<Tokenizer> tokenizer = [] {
    if (!std::filesystem::exists(kDeepSeekDir + "/tokenizer.json")) return std::unique_ptr<Tokenizer>();
    return std::make_unique<Tokenizer>(Tokenizer::from_file(kDeepSeekDir));
  }();
  return tokenizer.get();
}

}  // namespace dsv4::testing

#define REQUIRE_DEEPSEEK()                             \
  const Tokenizer* tok = ::dsv4::testing::deepseek();  \
  if (tok == nullptr)                                  \
  GTEST_SKIP() << "no " << ::dsv4::testing::kDeepSeekDir << "/tokenizer.json: run scripts/setup.sh"
