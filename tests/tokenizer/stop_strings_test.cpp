#include "tokenizer/stop_strings.h"

#include <gtest/gtest.h>

#include <random>

#include "core/error.h"

namespace dsv4 {
namespace {

// Feeds `text` in random pieces; returns what was emitted.
std::string stream(const std::string& text, std::vector<std::string> stops, uint32_t seed, bool* stopped) {
  StopStringMatcher matcher(std::move(stops));
  std::mt19937 rng(seed);
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const size_t n = std::min<size_t>(1 + rng() % 4, text.size() - i);
    out += matcher.push(std::string_view(text).substr(i, n));
    i += n;
  }
  out += matcher.flush();
  *stopped = matcher.stopped();
  return out;
}

TEST(StopStrings, MatchAcrossPiecesAndAreNotEmitted) {
  for (uint32_t seed = 0; seed < 50; ++seed) {
    bool stopped = false;
    EXPECT_EQ(stream("Hello world. END of text", {"END", "zzz"}, seed, &stopped), "Hello world. ");
    EXPECT_TRUE(stopped);
    EXPECT_EQ(stream("no stop here, EN EN", {"END"}, seed, &stopped), "no stop here, EN EN");
    EXPECT_FALSE(stopped);
    // Of several stop strings, the one that occurs first ends the text.
    EXPECT_EQ(stream("abcXYZdef uvw", {"uvw", "XYZ"}, seed, &stopped), "abc");
    EXPECT_EQ(stream("ab\n\nUser:", {"\n\nUser:"}, seed, &stopped), "ab");
  }
}

TEST(StopStrings, HoldsBackOnlyPossiblePrefixes) {
  StopStringMatcher matcher({"STOP"});
  EXPECT_EQ(matcher.push("abc ST"), "abc ");  // "ST" may begin STOP
  EXPECT_EQ(matcher.push("X"), "STX");        // it did not
  EXPECT_EQ(matcher.push("S"), "");
  EXPECT_EQ(matcher.push("TOP and more"), "");
  EXPECT_TRUE(matcher.stopped());
  EXPECT_EQ(matcher.matched(), "STOP");
  EXPECT_EQ(matcher.push("after"), "");
  EXPECT_THROW(StopStringMatcher({""}), Error);
}

}  // namespace
}  // namespace dsv4
