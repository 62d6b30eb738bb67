#include "bench/workload.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::bench {

std::vector<double> arrival_offsets(int64_t count, double rate, double burstiness, uint64_t seed) {
  DSV4_CHECK(count >= 0, "request count must be >= 0, got " + std::to_string(count));
  DSV4_CHECK(rate > 0.0, "request rate must be > 0 (inf: all at once), got " + std::to_string(rate));
  DSV4_CHECK(burstiness > 0.0 && std::isfinite(burstiness),
             "burstiness must be a positive number, got " + std::to_string(burstiness));
  std::vector<double> offsets(static_cast<size_t>(count), 0.0);
  if (std::isinf(rate)) return offsets;
  std::mt19937_64 rng(seed);
  // Gamma(shape k, scale theta) has mean k * theta; theta = 1 / (rate * k) keeps the mean gap at 1 / rate.
  std::gamma_distribution<double> gap(burstiness, 1.0 / (rate * burstiness));
  double now = 0.0;
  for (auto& offset : offsets) {
    now += gap(rng);
    offset = now;
  }
  return offsets;
}

std::vector<BenchmarkRequest> random_requests(const Tokenizer& tokenizer, int64_t count, int64_t input_len,
                                              int64_t output_len, uint64_t seed) {
  DSV4_CHECK(input_len >= 1, "--input-len must be >= 1, got " + std::to_string(input_len));
  DSV4_CHECK(output_len >= 1, "--output-len must be >= 1, got " + std::to_string(output_len));
  // Special tokens (BOS, EOS, chat markers) are left out: in a prompt they would change what the model does.
  std::vector<int32_t> ordinary;
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id)
    if (!tokenizer.is_special(id) && tokenizer.id_to_token(id)) ordinary.push_back(id);
  DSV4_CHECK(!ordinary.empty(), "the tokenizer has no ordinary tokens to build prompts from");

  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, ordinary.size() - 1);
  const auto append_random = [&](std::vector<int32_t>& ids, int64_t n) {
    for (int64_t i = 0; i < n; ++i) ids.push_back(ordinary[pick(rng)]);
  };
  constexpr int kMaxRounds = 16;
  std::vector<BenchmarkRequest> requests;
  requests.reserve(static_cast<size_t>(count));
  for (int64_t r = 0; r < count; ++r) {
    std::vector<int32_t> ids;
    append_random(ids, input_len);
    std::string best_text;
    int64_t best_len = 0;
    for (int round = 0; round < kMaxRounds; ++round) {
      std::string text = tokenizer.decode(ids);
      std::vector<int32_t> reencoded = tokenizer.encode(text);
      const auto len = static_cast<int64_t>(reencoded.size());
      if (round == 0 || std::llabs(len - input_len) < std::llabs(best_len - input_len)) {
        best_text = std::move(text);
        best_len = len;
      }
      if (len == input_len) break;
      ids = std::move(reencoded);
      if (len > input_len) ids.resize(static_cast<size_t>(input_len));
      else append_random(ids, input_len - len);
    }
    requests.push_back(BenchmarkRequest{std::move(best_text), best_len, output_len});
  }
  return requests;
}

}  // namespace dsv4::bench
