// The device sampler (ops/cuda/sampling.h) against the CPU sampler (engine/sampler.cpp `sample`) on the same
// request state: random logits (seeded, never zero) at the real vocabulary and small ones, rows of varied params
// (greedy, temperature, top_k 1/50/128/129/512/2000, top_p 0.3-0.999, min_p, penalties, min_tokens, logprobs), several
// steps each so that many u are drawn; ties to the lower index; −inf never sampled; the fallback paths (bins too
// large to sort, large top_k); bitwise repeats. The fixed-point weight is checked on the host (no GPU needed).
#include "engine/sampler.cpp"  // the CPU reference: dsv4_gpu_tests does not link dsv4_engine

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "ops/cuda/device.h"
#include "ops/cuda/sampling.h"

namespace dsv4::ops::cuda {
namespace {

#define REQUIRE_DEVICE()                                    \
  do {                                                      \
    if (list_devices().empty()) GTEST_SKIP() << "no CUDA device"; \
  } while (false)

constexpr int64_t kVocab = 129280;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  explicit DeviceArray(size_t n) { EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess); }
  DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

struct Row {
  SamplingParams params;
  std::vector<int32_t> tokens;  // prompt + output so far
  int64_t num_prompt = 0;
  std::vector<int32_t> eos;
  std::string name;
};

struct Batch {
  int64_t vocab = 0;
  std::vector<float> logits;  // [rows, vocab]
  std::vector<Row> rows;
};

// Random logits of scale `sigma`, never exactly zero.
void fill_row(float* out, int64_t vocab, std::mt19937& rng, float sigma, float shift = 0.0f) {
  std::normal_distribution<float> normal(0.0f, sigma);
  for (int64_t i = 0; i < vocab; ++i) {
    float v = normal(rng) + shift;
    if (v == 0.0f) v = 1e-3f;
    out[i] = v;
  }
}

// The device's outputs for the rows, given their states (advanced by the draws, as the CPU's are).
std::vector<SamplingOutput> run_device(const Batch& b, std::vector<RequestSamplerState>& states, bool full_plan) {
  SamplingBatch packed;
  for (size_t r = 0; r < b.rows.size(); ++r) pack_sampling_row(packed, b.rows[r].params, states[r], b.rows[r].tokens);
  const auto rows = static_cast<int64_t>(b.rows.size());
  DeviceArray<float> logits(b.logits);
  DeviceArray<SamplingRow> params(packed.rows);
  DeviceArray<int32_t> history(packed.history), stops(packed.stop_ids);
  DeviceArray<SamplingOutput> out(b.rows.size());
  const size_t ws_bytes = sampling_workspace_bytes(rows, b.vocab);
  DeviceArray<unsigned char> ws(ws_bytes);
  EXPECT_EQ(cudaMemset(out.ptr, 0xab, b.rows.size() * sizeof(SamplingOutput)), cudaSuccess);  // poison
  EXPECT_EQ(cudaMemset(ws.ptr, 0xcd, ws_bytes), cudaSuccess);
  SamplingArgs args;
  args.logits = logits.ptr;
  args.rows = rows;
  args.vocab = b.vocab;
  args.logits_stride = b.vocab;
  args.params = params.ptr;
  args.history = packed.history.empty() ? nullptr : history.ptr;
  args.stop_ids = packed.stop_ids.empty() ? nullptr : stops.ptr;
  args.out = out.ptr;
  args.chunk_extras = full_plan || packed.needs_chunk_extras;
  args.full_path = full_plan || packed.needs_full_path;
  args.logprobs = full_plan || packed.needs_logprobs;
  EXPECT_EQ(sample_tokens(args, ws.ptr, ws_bytes, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<SamplingOutput> host(b.rows.size());
  EXPECT_EQ(cudaMemcpy(host.data(), out.ptr, host.size() * sizeof(SamplingOutput), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

// `steps` rounds: the device and the CPU sample every row from twin states; the CPU's token is appended to the
// row's tokens (both must agree). Returns the number of rows compared.
int compare_with_cpu(Batch b, int steps, bool full_plan = false) {
  std::vector<RequestSamplerState> cpu_states, dev_states;
  for (const Row& r : b.rows) {
    cpu_states.push_back(make_sampler_state(r.params, r.num_prompt, r.eos));
    dev_states.push_back(make_sampler_state(r.params, r.num_prompt, r.eos));
  }
  int compared = 0;
  for (int step = 0; step < steps; ++step) {
    const std::vector<SamplingOutput> dev = run_device(b, dev_states, full_plan);
    for (size_t r = 0; r < b.rows.size(); ++r) {
      Row& row = b.rows[r];
      const std::span<const float> logits(b.logits.data() + r * b.vocab, static_cast<size_t>(b.vocab));
      SampleResult expected;
      const int32_t token = sample(logits, row.params, cpu_states[r], row.tokens, &expected);
      const std::string where = row.name + " (row " + std::to_string(r) + ", step " + std::to_string(step) +
                                ", vocab " + std::to_string(b.vocab) + ")";
      EXPECT_EQ(dev[r].token, token) << where;
      const bool any_finite = std::any_of(logits.begin(), logits.end(), [](float v) { return v > kNegInf; });
      if (any_finite && dev[r].token >= 0 && dev[r].token < b.vocab) {
        EXPECT_GT(logits[static_cast<size_t>(dev[r].token)], kNegInf) << where;
      }
      if (row.params.logprobs) {
        EXPECT_NEAR(dev[r].logprob, expected.logprob, 1e-5) << where;
        EXPECT_EQ(dev[r].rank, expected.rank) << where;
        EXPECT_EQ(static_cast<size_t>(dev[r].num_top), expected.top.size()) << where;
        for (size_t j = 0; j < expected.top.size() && j < static_cast<size_t>(kSamplingMaxLogprobs); ++j) {
          EXPECT_EQ(dev[r].top_ids[j], expected.top[j].token) << where << " top " << j;
          EXPECT_NEAR(dev[r].top_logprobs[j], expected.top[j].logprob, 1e-5) << where << " top " << j;
        }
      }
      row.tokens.push_back(token);
      ++compared;
    }
  }
  return compared;
}

SamplingParams sampled(double temperature, uint64_t seed) {
  SamplingParams p;
  p.temperature = temperature;
  p.seed = seed;
  return p;
}

// The varied rows of the main comparison, over `vocab` tokens.
Batch varied_batch(int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b;
  b.vocab = vocab;
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  auto history = [&](int n) {
    std::vector<int32_t> h;
    for (int i = 0; i < n; ++i) h.push_back(token(rng) % std::max<int32_t>(1, static_cast<int32_t>(vocab / 50)));
    return h;  // repeats often: counts > 1
  };
  auto add = [&](std::string name, SamplingParams p, int prompt = 8, int output = 4) {
    Row r;
    r.name = std::move(name);
    r.params = std::move(p);
    r.tokens = history(prompt + output);
    r.num_prompt = prompt;
    r.eos = {1, static_cast<int32_t>(vocab - 1)};
    b.rows.push_back(std::move(r));
  };
  uint64_t s = seed * 1000ull;
  add("greedy", SamplingParams{});
  {
    SamplingParams p;
    p.logprobs = 5;
    add("greedy logprobs 5", p);
  }
  {
    SamplingParams p;
    p.repetition_penalty = 1.3;
    p.frequency_penalty = 0.4;
    add("greedy penalties", p, 64, 32);
  }
  {
    SamplingParams p;
    p.min_tokens = 6;
    add("greedy min_tokens", p, 8, 2);
  }
  add("t0.7", sampled(0.7, ++s));
  {
    SamplingParams p = sampled(0.7, ++s);
    p.top_k = 1;
    add("t0.7 top_k 1", p);
  }
  {
    SamplingParams p = sampled(0.7, ++s);
    p.top_k = 50;
    add("t0.7 top_k 50", p);
  }
  {
    SamplingParams p = sampled(1.0, ++s);
    p.top_p = 0.9;
    add("t1 top_p 0.9", p);
  }
  {
    SamplingParams p = sampled(0.7, ++s);
    p.top_p = 0.5;
    add("t0.7 top_p 0.5", p);
  }
  {
    SamplingParams p = sampled(1.0, ++s);
    p.min_p = 0.1;
    add("t1 min_p 0.1", p);
  }
  {
    SamplingParams p = sampled(0.8, ++s);
    p.top_k = 50;
    p.top_p = 0.9;
    p.min_p = 0.05;
    add("t0.8 top_k 50 top_p 0.9 min_p 0.05", p);
  }
  {
    SamplingParams p = sampled(1.0, ++s);
    p.repetition_penalty = 1.2;
    p.frequency_penalty = 0.5;
    p.presence_penalty = 0.3;
    p.top_p = 0.95;
    add("t1 penalties top_p 0.95", p, 200, 100);
  }
  {
    SamplingParams p = sampled(0.9, ++s);
    p.min_tokens = 10;
    p.stop_token_ids = {2, 3};
    p.top_k = 20;
    add("t0.9 min_tokens top_k 20", p, 4, 3);
  }
  {
    SamplingParams p = sampled(1.5, ++s);
    p.top_k = 2000;
    add("t1.5 top_k 2000", p);
  }
  {
    SamplingParams p = sampled(1.0, ++s);
    p.top_k = 2000;
    p.top_p = 0.8;
    add("t1 top_k 2000 top_p 0.8", p);
  }
  {
    SamplingParams p = sampled(0.3, ++s);
    p.top_p = 0.9;
    add("t0.3 top_p 0.9", p);
  }
  {
    SamplingParams p = sampled(1.0, ++s);
    p.top_p = 0.9;
    p.logprobs = 20;
    add("t1 top_p 0.9 logprobs 20", p);
  }
  {
    SamplingParams p = sampled(1.0, ++s);
    p.top_k = 128;  // the largest merged in pass 2
    add("t1 top_k 128", p);
  }
  {
    SamplingParams p = sampled(1.0, ++s);
    p.top_k = 129;  // the smallest cut by the radix select
    p.logprobs = 0;
    add("t1 top_k 129 logprobs 0", p);
  }
  {
    SamplingParams p = sampled(1.0, ++s);
    p.top_k = 512;
    p.top_p = 0.95;
    add("t1 top_k 512 top_p 0.95", p);
  }
  add("t0.05", sampled(0.05, ++s));
  {
    SamplingParams p = sampled(1.0, ++s);
    p.top_p = 0.999;
    add("t1 top_p 0.999", p);
  }
  {
    SamplingParams p = sampled(2.0, ++s);
    p.top_p = 0.3;
    p.frequency_penalty = -0.5;
    p.presence_penalty = -0.2;
    add("t2 top_p 0.3 negative penalties", p, 16, 40);
  }
  {
    SamplingParams p = sampled(1.2, ++s);
    p.min_p = 0.3;
    p.top_p = 0.7;
    p.repetition_penalty = 0.8;
    add("t1.2 min_p 0.3 top_p 0.7 repetition 0.8", p, 30, 10);
  }
  {
    SamplingParams p = sampled(0.6, ++s);
    p.top_k = 3;
    p.top_p = 0.6;
    p.logprobs = 3;
    add("t0.6 top_k 3 top_p 0.6 logprobs 3", p);
  }
  b.logits.resize(b.rows.size() * static_cast<size_t>(vocab));
  const float sigmas[] = {1.0f, 2.0f, 4.0f, 0.5f, 3.0f};
  for (size_t r = 0; r < b.rows.size(); ++r) {
    fill_row(b.logits.data() + r * vocab, vocab, rng, sigmas[r % 5]);
    // min_tokens rows: the eos id 1 is by far the largest logit, so only the suppression keeps it out.
    if (b.rows[r].params.min_tokens > 0 && vocab > 1) b.logits[r * vocab + 1] = 40.0f;
  }
  return b;
}

TEST(CudaSampling, FixedPointWeightIsExpRounded) {  // host code: runs without a GPU
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> max_dist(-30.0f, 60.0f), gap(0.0f, 34.0f);
  int64_t worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const float max = max_dist(rng);
    const float t = i % 1000 == 0 ? max : max - gap(rng);
    const double exact = std::exp(static_cast<double>(t) - static_cast<double>(max)) * 0x1p45;
    const auto expected = static_cast<int64_t>(std::llround(exact));
    const auto actual = static_cast<int64_t>(sampling_fixed_weight(t, max));
    worst = std::max(worst, std::abs(actual - expected));
    ASSERT_LE(std::abs(actual - expected), 1) << "t " << t << " max " << max;
  }
  EXPECT_EQ(sampling_fixed_weight(-1e30f, 0.0f), 0u);
  EXPECT_EQ(sampling_fixed_weight(kNegInf, 0.0f), 0u);
  EXPECT_EQ(sampling_fixed_weight(3.0f, 3.0f), uint64_t{1} << 45);
  std::printf("fixed-point weight: worst |error| %lld unit(s) of 2^-45\n", static_cast<long long>(worst));
}

TEST(CudaSampling, MatchesCpuSamplerAtTheRealVocabulary) {
  REQUIRE_DEVICE();
  for (const uint32_t seed : {1u, 2u}) EXPECT_GT(compare_with_cpu(varied_batch(kVocab, seed), 3), 0);
}

TEST(CudaSampling, MatchesCpuSamplerAtSmallVocabularies) {
  REQUIRE_DEVICE();
  for (const int64_t vocab : {10, 257, 1000, 8192, 8193, 20000})
    EXPECT_GT(compare_with_cpu(varied_batch(vocab, static_cast<uint32_t>(vocab)), 3), 0);
}

TEST(CudaSampling, EveryKernelLaunchedGivesTheSameTokens) {  // the CUDA-graph plan: all passes always launched
  REQUIRE_DEVICE();
  EXPECT_GT(compare_with_cpu(varied_batch(5000, 99), 2, true), 0);
}

TEST(CudaSampling, TiesGoToTheLowerIndex) {
  REQUIRE_DEVICE();
  Batch b;
  b.vocab = 4000;
  std::mt19937 rng(11);
  auto add = [&](std::string name, SamplingParams p, std::vector<float> logits) {
    Row r;
    r.name = std::move(name);
    r.params = std::move(p);
    r.tokens = {5};
    r.num_prompt = 1;
    b.rows.push_back(std::move(r));
    b.logits.insert(b.logits.end(), logits.begin(), logits.end());
  };
  std::vector<float> flat(4000, 0.25f);
  std::vector<float> two_max(4000);
  fill_row(two_max.data(), 4000, rng, 1.0f);
  two_max[3000] = two_max[1234] = 9.0f;  // equal maxima
  std::vector<float> steps(4000);  // values repeated in blocks of 7: ties at any top_k / top_p boundary
  for (int i = 0; i < 4000; ++i) steps[i] = 0.01f * static_cast<float>((i * 7919) % 571) + 0.5f;
  SamplingParams greedy;
  add("greedy flat", greedy, flat);
  add("greedy two maxima", greedy, two_max);
  greedy.logprobs = 8;
  add("greedy flat logprobs 8", greedy, flat);
  add("greedy steps logprobs 8", greedy, steps);
  uint64_t seed = 40;
  for (const auto* logits : {&flat, &steps, &two_max}) {
    SamplingParams p = sampled(1.0, ++seed);
    add("t1", p, *logits);
    p.seed = ++seed;
    p.top_k = 10;
    add("t1 top_k 10", p, *logits);
    p.seed = ++seed;
    p.top_k = 1000;
    add("t1 top_k 1000", p, *logits);
    p.seed = ++seed;
    p.top_k = 0;
    p.top_p = 0.5;
    add("t1 top_p 0.5", p, *logits);
    p.seed = ++seed;
    p.top_k = 7;
    p.top_p = 0.9;
    add("t1 top_k 7 top_p 0.9", p, *logits);
  }
  const auto n = compare_with_cpu(b, 4);
  EXPECT_GT(n, 0);
  // Explicit expectations for the greedy rows (the CPU agrees by the comparison above).
  std::vector<RequestSamplerState> states(b.rows.size());
  const std::vector<SamplingOutput> out = run_device(b, states, false);
  EXPECT_EQ(out[0].token, 0);
  EXPECT_EQ(out[1].token, 1234);
  EXPECT_EQ(out[2].top_ids[0], 0);
  EXPECT_EQ(out[2].top_ids[7], 7);
}

TEST(CudaSampling, NegativeInfinityIsNeverSampled) {
  REQUIRE_DEVICE();
  Batch b;
  b.vocab = kVocab;
  std::mt19937 rng(5);
  std::bernoulli_distribution masked(0.97);
  for (int r = 0; r < 24; ++r) {
    std::vector<float> row(kVocab);
    fill_row(row.data(), kVocab, rng, r % 2 ? 3.0f : 0.3f);
    for (auto& v : row)
      if (masked(rng)) v = kNegInf;
    row[static_cast<size_t>(r) * 4001 % kVocab] = 50.0f;  // the largest logit, suppressed by min_tokens below
    Row spec;
    spec.name = "masked " + std::to_string(r);
    spec.params = sampled(r % 3 == 0 ? 5.0 : 1.0, 100 + r);
    if (r % 4 == 1) spec.params.top_p = 0.95;
    if (r % 4 == 2) spec.params.top_k = 40;
    if (r % 4 == 3) spec.params.min_p = 0.01;
    spec.params.min_tokens = 3;
    spec.params.stop_token_ids = {static_cast<int32_t>(static_cast<size_t>(r) * 4001 % kVocab)};
    spec.tokens = {7, 8};
    spec.num_prompt = 2;
    b.rows.push_back(spec);
    b.logits.insert(b.logits.end(), row.begin(), row.end());
  }
  EXPECT_GT(compare_with_cpu(b, 4), 0);  // compare_with_cpu also checks the token's logit is finite
  // Every logit −inf: token 0, as the CPU (one step only: the CPU does not draw then).
  Batch all;
  all.vocab = 3000;
  all.logits.assign(2 * 3000, kNegInf);
  for (int r = 0; r < 2; ++r) {
    Row spec;
    spec.name = "all -inf";
    spec.params = sampled(1.0, 9 + r);
    if (r) spec.params.top_k = 5;
    spec.tokens = {1};
    spec.num_prompt = 1;
    all.rows.push_back(spec);
  }
  EXPECT_GT(compare_with_cpu(all, 1), 0);
}

TEST(CudaSampling, LargeBinsAndLargeTopKTakeTheExactFallback) {
  REQUIRE_DEVICE();
  Batch b;
  b.vocab = kVocab;
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> tiny(1.0f, 1.0001f), narrow(0.0f, 0.5f);
  auto add = [&](std::string name, SamplingParams p, int kind) {
    std::vector<float> row(kVocab);
    for (auto& v : row) v = kind == 0 ? tiny(rng) : kind == 1 ? 0.75f : narrow(rng);
    Row spec;
    spec.name = std::move(name);
    spec.params = std::move(p);
    spec.tokens = {3};
    spec.num_prompt = 1;
    b.rows.push_back(spec);
    b.logits.insert(b.logits.end(), row.begin(), row.end());
  };
  uint64_t seed = 500;
  for (int kind = 0; kind < 3; ++kind) {
    const std::string k = kind == 0 ? "1e-4 wide" : kind == 1 ? "all equal" : "0.5 wide";
    SamplingParams p = sampled(1.0, ++seed);
    p.top_p = 0.5;
    add(k + " top_p 0.5", p, kind);
    p.seed = ++seed;
    p.top_p = 0.97;
    add(k + " top_p 0.97", p, kind);
    p.seed = ++seed;
    p.top_p = 1.0;
    p.top_k = 5000;
    add(k + " top_k 5000", p, kind);
    p.seed = ++seed;
    p.top_p = 0.6;
    p.top_k = 70000;
    add(k + " top_k 70000 top_p 0.6", p, kind);
    p.seed = ++seed;
    p.top_k = 0;
    p.top_p = 1.0;
    p.min_p = 0.9999;
    add(k + " min_p 0.9999", p, kind);
  }
  EXPECT_GT(compare_with_cpu(b, 3), 0);
}

TEST(CudaSampling, RepeatsBitwise) {
  REQUIRE_DEVICE();
  const Batch b = varied_batch(kVocab, 3);
  std::vector<RequestSamplerState> s1, s2;
  for (const Row& r : b.rows) {
    s1.push_back(make_sampler_state(r.params, r.num_prompt, r.eos));
    s2.push_back(make_sampler_state(r.params, r.num_prompt, r.eos));
  }
  const auto first = run_device(b, s1, false);
  const auto second = run_device(b, s2, true);
  ASSERT_EQ(first.size(), second.size());
  for (size_t r = 0; r < first.size(); ++r) {
    EXPECT_EQ(first[r].token, second[r].token) << r;
    if (b.rows[r].params.logprobs) {
      EXPECT_EQ(std::memcmp(&first[r], &second[r], sizeof(SamplingOutput)), 0) << "row " << r;
    }
  }
}

TEST(CudaSampling, RejectsBadShapes) {
  REQUIRE_DEVICE();
  SamplingArgs a;
  a.rows = 1;
  a.vocab = kSamplingMaxVocab + 1;
  a.logits_stride = a.vocab;
  EXPECT_EQ(sample_tokens(a, nullptr, 0, nullptr), cudaErrorInvalidValue);
  a.vocab = 100;
  a.logits_stride = 50;
  EXPECT_EQ(sample_tokens(a, nullptr, 0, nullptr), cudaErrorInvalidValue);
  a.rows = 0;
  a.logits_stride = 100;
  EXPECT_EQ(sample_tokens(a, nullptr, 0, nullptr), cudaSuccess);
  cudaGetLastError();
}

}  // namespace
}  // namespace dsv4::ops::cuda
