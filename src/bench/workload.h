// What the benchmark sends and when: the arrival schedule and vLLM-style random prompts.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {
class Tokenizer;
}

namespace dsv4::bench {

// Arrival time of each of `count` requests, in seconds after the benchmark starts (the first is 0 plus its
// gap). Gaps are gamma-distributed with shape `burstiness` and mean 1/`rate`: burstiness 1 is a Poisson process
// (exponential gaps), below 1 burstier, above 1 more regular. `rate` = infinity sends everything at time 0.
std::vector<double> arrival_offsets(int64_t count, double rate, double burstiness, uint64_t seed);

struct BenchmarkRequest {
  std::string prompt;
  int64_t prompt_len = 0;   // tokens of `prompt` under the benchmark's tokenizer
  int64_t max_tokens = 0;
};

// `count` prompts of `input_len` tokens each, as vLLM's random dataset builds them: token ids drawn uniformly
// from the tokenizer's non-special vocabulary and decoded to text. Decoding then re-encoding random ids rarely
// gives the same count (bytes merge into new tokens, invalid UTF-8 becomes U+FFFD), so the prompt is re-encoded
// and trimmed or topped up with more random ids until it encodes to exactly `input_len` tokens (or the closest
// length reached in a bounded number of rounds; `prompt_len` is the length it really has).
std::vector<BenchmarkRequest> random_requests(const Tokenizer& tokenizer, int64_t count, int64_t input_len,
                                              int64_t output_len, uint64_t seed);

}  // namespace dsv4::bench
