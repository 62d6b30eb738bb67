// The routed + shared MoE experts on the device (ops/cuda/moe_experts.h) against a CPU reference built like the
// kHf loop of DeepseekV4Model::moe (ops/cpu/linear.h + ops/cpu/moe.h swiglu_clamped): fp32 mode at a tiny shape
// to 1e-5, bf16 mode at the V4-Flash expert shape (D 4096, I 2048, top-k 6) against the reference fed with the
// bf16-rounded weights and inputs, every tile configuration, hot and never-chosen experts, out-of-range ids,
// bitwise repeats and a CUDA-graph replay. Outputs and workspaces are poisoned before every call. Skips
// without a GPU.
#include "ops/cuda/moe_experts.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/linear_weight.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/quantize.h"
#include "ops/cuda/device.h"

namespace dsv4::ops::cuda {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

class CudaMoeExperts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (list_devices().empty()) GTEST_SKIP() << "no CUDA device";
  }
};

// Uniform in [-1, 1) from the raw generator (fast enough for the 9 × 25M weights of the V4-Flash sets).
float uniform(std::mt19937& rng) { return static_cast<float>(rng() >> 8) * 0x1p-23f - 1.0f; }

// Distinct weight sets; expert e uses set expert_set[e] (the device pointer table aliases them), so E = 256 costs
// the memory of 8 experts and the reference groups rows by set.
struct ExpertSets {
  int64_t D = 0, I = 0;
  bool bf16 = false;
  std::vector<std::vector<float>> w13, w2;  // [sets]; the last one is the shared expert's
  std::vector<void*> device_w13, device_w2;

  ExpertSets(int64_t d, int64_t i, int sets, bool round_bf16, uint32_t seed) : D(d), I(i), bf16(round_bf16) {
    std::mt19937 rng(seed);
    const float s13 = 2.5f / std::sqrt(static_cast<float>(D)), s2 = 1.0f / std::sqrt(static_cast<float>(I));
    for (int s = 0; s < sets + 1; ++s) {
      std::vector<float> a(static_cast<size_t>(2 * I * D)), b(static_cast<size_t>(D * I));
      for (auto& v : a) v = s13 * uniform(rng);
      for (auto& v : b) v = s2 * uniform(rng);
      if (bf16) {
        for (auto& v : a) v = bf16_to_f32(f32_to_bf16(v));
        for (auto& v : b) v = bf16_to_f32(f32_to_bf16(v));
      }
      device_w13.push_back(upload(a));
      device_w2.push_back(upload(b));
      w13.push_back(std::move(a));
      w2.push_back(std::move(b));
    }
  }
  ExpertSets(const ExpertSets&) = delete;
  ExpertSets& operator=(const ExpertSets&) = delete;
  ~ExpertSets() {
    for (void* p : device_w13) cudaFree(p);
    for (void* p : device_w2) cudaFree(p);
  }
  int routed_sets() const { return static_cast<int>(w13.size()) - 1; }

  void* upload(const std::vector<float>& v) const {
    void* d = nullptr;
    if (bf16) {
      std::vector<uint16_t> bits(v.size());
      for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16(v[i]);
      if (cudaMalloc(&d, bits.size() * 2) != cudaSuccess) return nullptr;
      cudaMemcpy(d, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice);
    } else {
      if (cudaMalloc(&d, v.size() * 4) != cudaSuccess) return nullptr;
      cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
    }
    return d;
  }
};

// The V4-Flash expert shape in bf16, built once per process (~1 GB of host fp32, 0.4 GB on the device).
const ExpertSets& flash_sets() {
  static const ExpertSets sets(4096, 2048, 8, true, 2024);
  return sets;
}

struct Problem {
  int64_t tokens = 0, top_k = 0, experts = 0;
  float limit = 2.0f;
  std::vector<float> x, weights;
  std::vector<int32_t> chosen;
  std::vector<int> expert_set;  // [experts] -> routed set
};

Problem random_problem(int64_t tokens, int64_t top_k, int64_t experts, int64_t D, int routed_sets, float limit,
                       uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  Problem pr;
  pr.tokens = tokens;
  pr.top_k = top_k;
  pr.experts = experts;
  pr.limit = limit;
  pr.x.resize(static_cast<size_t>(tokens * D));
  for (auto& v : pr.x) v = normal(rng);
  pr.weights.resize(static_cast<size_t>(tokens * top_k));
  for (auto& v : pr.weights) v = weight(rng);
  std::vector<int32_t> ids(static_cast<size_t>(experts));
  std::iota(ids.begin(), ids.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(ids.begin(), ids.end(), rng);  // distinct experts per token, as the router picks them
    pr.chosen.insert(pr.chosen.end(), ids.begin(), ids.begin() + top_k);
  }
  pr.expert_set.resize(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) pr.expert_set[e] = static_cast<int>((e * 5 + 3) % routed_sets);
  return pr;
}

// The kHf loop of DeepseekV4Model::moe with the experts grouped by weight set (one GEMM pair per set); ids
// outside [0, E) contribute nothing. `round_x` feeds bf16-rounded inputs (the bf16 mode's own rounding).
std::vector<float> reference(const Problem& pr, const ExpertSets& sets, bool round_x) {
  const int64_t N = pr.tokens, K = pr.top_k, D = sets.D, I = sets.I;
  std::vector<float> x = pr.x;
  if (round_x)
    for (auto& v : x) v = bf16_to_f32(f32_to_bf16(v));
  std::vector<float> out(static_cast<size_t>(N * D), 0.0f);
  std::vector<float> rows, gate_up, activated, expert_out;
  for (int s = 0; s < sets.routed_sets(); ++s) {
    std::vector<std::pair<int64_t, float>> assigned;
    for (int64_t t = 0; t < N; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = pr.chosen[t * K + k];
        if (e >= 0 && e < pr.experts && pr.expert_set[e] == s) assigned.emplace_back(t, pr.weights[t * K + k]);
      }
    if (assigned.empty()) continue;
    const auto n = static_cast<int64_t>(assigned.size());
    rows.resize(static_cast<size_t>(n * D));
    for (int64_t i = 0; i < n; ++i) std::memcpy(&rows[i * D], &x[assigned[i].first * D], D * sizeof(float));
    gate_up.resize(static_cast<size_t>(n * 2 * I));
    cpu::linear(rows.data(), n, D, sets.w13[s].data(), 2 * I, gate_up.data());
    activated.resize(static_cast<size_t>(n * I));
    cpu::swiglu_clamped(gate_up.data(), n, I, pr.limit, activated.data());
    expert_out.resize(static_cast<size_t>(n * D));
    cpu::linear(activated.data(), n, I, sets.w2[s].data(), D, expert_out.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < D; ++j) out[assigned[i].first * D + j] += assigned[i].second * expert_out[i * D + j];
  }
  const int shared = sets.routed_sets();
  gate_up.resize(static_cast<size_t>(N * 2 * I));
  cpu::linear(x.data(), N, D, sets.w13[shared].data(), 2 * I, gate_up.data());
  activated.resize(static_cast<size_t>(N * I));
  cpu::swiglu_clamped(gate_up.data(), N, I, pr.limit, activated.data());
  cpu::linear(activated.data(), N, I, sets.w2[shared].data(), D, out.data(), /*beta=*/1.0f);
  return out;
}

// One problem on the device: inputs, the per-expert pointer tables, the workspace, the output.
struct DeviceRun {
  MoeExpertsParams params;
  MoeExpertWeights weights;
  float *x = nullptr, *routing_weights = nullptr, *out = nullptr;
  int32_t* chosen = nullptr;
  const void** w13_table = nullptr;
  const void** w2_table = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  DeviceRun(const Problem& pr, const ExpertSets& sets) {
    params.tokens = pr.tokens;
    params.top_k = pr.top_k;
    params.experts = pr.experts;
    params.hidden = sets.D;
    params.intermediate = sets.I;
    params.swiglu_limit = pr.limit;
    params.dtype = sets.bf16 ? MoeWeightDtype::kBf16 : MoeWeightDtype::kFp32;
    cudaMalloc(&x, pr.x.size() * 4);
    cudaMemcpy(x, pr.x.data(), pr.x.size() * 4, cudaMemcpyHostToDevice);
    cudaMalloc(&routing_weights, pr.weights.size() * 4);
    cudaMemcpy(routing_weights, pr.weights.data(), pr.weights.size() * 4, cudaMemcpyHostToDevice);
    cudaMalloc(&chosen, pr.chosen.size() * 4);
    cudaMemcpy(chosen, pr.chosen.data(), pr.chosen.size() * 4, cudaMemcpyHostToDevice);
    cudaMalloc(&out, pr.x.size() * 4);
    std::vector<const void*> t13(static_cast<size_t>(pr.experts)), t2(static_cast<size_t>(pr.experts));
    for (int64_t e = 0; e < pr.experts; ++e) {
      t13[e] = sets.device_w13[pr.expert_set[e]];
      t2[e] = sets.device_w2[pr.expert_set[e]];
    }
    cudaMalloc(reinterpret_cast<void**>(&w13_table), t13.size() * sizeof(void*));
    cudaMalloc(reinterpret_cast<void**>(&w2_table), t2.size() * sizeof(void*));
    cudaMemcpy(w13_table, t13.data(), t13.size() * sizeof(void*), cudaMemcpyHostToDevice);
    cudaMemcpy(w2_table, t2.data(), t2.size() * sizeof(void*), cudaMemcpyHostToDevice);
    weights.w13 = w13_table;
    weights.w2 = w2_table;
    weights.shared_w13 = sets.device_w13.back();
    weights.shared_w2 = sets.device_w2.back();
    workspace_bytes = moe_experts_workspace_bytes(params);
    cudaMalloc(&workspace, workspace_bytes);
  }
  DeviceRun(const DeviceRun&) = delete;
  DeviceRun& operator=(const DeviceRun&) = delete;
  ~DeviceRun() {
    for (void* p : {static_cast<void*>(x), static_cast<void*>(routing_weights), static_cast<void*>(out),
                    static_cast<void*>(chosen), static_cast<void*>(w13_table), static_cast<void*>(w2_table),
                    workspace})
      if (p) cudaFree(p);
  }

  cudaError_t launch(cudaStream_t stream = nullptr) {
    return moe_experts(params, weights, x, chosen, routing_weights, out, workspace, workspace_bytes, stream);
  }
  // Poisons the output (NaN) and the workspace, runs, and reads the output back.
  std::vector<float> run(int tile_rows = 0) {
    params.tile_rows = tile_rows;
    std::vector<float> host(static_cast<size_t>(params.tokens * params.hidden));
    if (cudaMemset(out, 0xff, host.size() * 4) != cudaSuccess ||
        cudaMemset(workspace, 0xa5, workspace_bytes) != cudaSuccess) {
      ADD_FAILURE() << "poisoning failed";
      return {};
    }
    const cudaError_t status = launch();
    if (status != cudaSuccess) {
      ADD_FAILURE() << "moe_experts: " << cudaGetErrorString(status);
      return {};
    }
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(host.data(), out, host.size() * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
      ADD_FAILURE() << "device error: " << cudaGetErrorString(cudaGetLastError());
      return {};
    }
    return host;
  }
  // The same problem split as the model runs it: the shared expert alone (kOnly) on a second stream, then the
  // routed call (kAdded) on a first one, whose combine waits on an event after the first call. Fresh,
  // poisoned workspaces and outputs.
  std::vector<float> run_split(int tile_rows = 0) {
    params.tile_rows = tile_rows;
    MoeExpertsParams only = params, added = params;
    only.shared = MoeSharedExpert::kOnly;
    added.shared = MoeSharedExpert::kAdded;
    const size_t only_bytes = moe_experts_workspace_bytes(only), added_bytes = moe_experts_workspace_bytes(added);
    const size_t count = static_cast<size_t>(params.tokens * params.hidden);
    void *only_ws = nullptr, *added_ws = nullptr;
    float* shared_out = nullptr;
    cudaStream_t routed_stream = nullptr, shared_stream = nullptr;
    cudaEvent_t shared_done = nullptr;
    std::vector<float> host(count);
    const bool ready = cudaMalloc(&only_ws, only_bytes) == cudaSuccess &&
                       cudaMalloc(&added_ws, added_bytes) == cudaSuccess &&
                       cudaMalloc(&shared_out, count * 4) == cudaSuccess &&
                       cudaMemset(only_ws, 0xa5, only_bytes) == cudaSuccess &&
                       cudaMemset(added_ws, 0xa5, added_bytes) == cudaSuccess &&
                       cudaMemset(shared_out, 0xff, count * 4) == cudaSuccess &&
                       cudaMemset(out, 0xff, count * 4) == cudaSuccess &&
                       cudaStreamCreateWithFlags(&routed_stream, cudaStreamNonBlocking) == cudaSuccess &&
                       cudaStreamCreateWithFlags(&shared_stream, cudaStreamNonBlocking) == cudaSuccess &&
                       cudaEventCreateWithFlags(&shared_done, cudaEventDisableTiming) == cudaSuccess &&
                       cudaDeviceSynchronize() == cudaSuccess;
    EXPECT_TRUE(ready) << "setup failed";
    if (ready) {
      EXPECT_EQ(moe_experts(only, weights, x, nullptr, nullptr, shared_out, only_ws, only_bytes, shared_stream),
                cudaSuccess);
      EXPECT_EQ(cudaEventRecord(shared_done, shared_stream), cudaSuccess);
      EXPECT_EQ(moe_experts(added, weights, x, chosen, routing_weights, out, added_ws, added_bytes, routed_stream,
                            shared_out, shared_done),
                cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host.data(), out, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    if (shared_done) cudaEventDestroy(shared_done);
    for (cudaStream_t st : {routed_stream, shared_stream})
      if (st) cudaStreamDestroy(st);
    for (void* ptr : {only_ws, added_ws, static_cast<void*>(shared_out)})
      if (ptr) cudaFree(ptr);
    return host;
  }
};

// Relative L2 error; +inf when an element is not finite (unwritten poison or overflow) or sizes differ.
double rel_l2(const std::vector<float>& actual, const std::vector<float>& expected) {
  if (actual.size() != expected.size() || actual.empty()) return INFINITY;
  double err = 0, norm = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) return INFINITY;
    const double d = static_cast<double>(actual[i]) - expected[i];
    err += d * d;
    norm += static_cast<double>(expected[i]) * expected[i];
  }
  return std::sqrt(err / norm);
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && !a.empty() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST_F(CudaMoeExperts, Fp32MatchesCpuTiny) {
  const ExpertSets sets(64, 32, 8, false, 7);
  for (int64_t tokens = 1; tokens <= 37; ++tokens) {
    const Problem pr = random_problem(tokens, 2, 8, 64, 8, 1.5f, static_cast<uint32_t>(100 + tokens));
    DeviceRun dev(pr, sets);
    const std::vector<float> expected = reference(pr, sets, false);
    const std::vector<float> actual = dev.run();
    EXPECT_LE(rel_l2(actual, expected), 1e-5) << "tokens " << tokens;
    EXPECT_TRUE(bitwise_equal(actual, dev.run())) << "tokens " << tokens << ": not bitwise repeatable";
  }
}

TEST_F(CudaMoeExperts, Fp32HotColdAndOutOfRangeIds) {
  const ExpertSets sets(64, 32, 8, false, 9);
  Problem pr = random_problem(37, 2, 8, 64, 8, 1.5f, 11);
  // Expert 3 in every token's list; experts 6 and 7 in none; two ids out of range (contribute nothing).
  std::mt19937 rng(12);
  for (int64_t t = 0; t < pr.tokens; ++t) {
    pr.chosen[t * 2] = 3;
    pr.chosen[t * 2 + 1] = std::vector<int32_t>{0, 1, 2, 4, 5}[rng() % 5];
  }
  pr.chosen[5] = -1;
  pr.chosen[20] = 8;
  DeviceRun dev(pr, sets);
  const std::vector<float> expected = reference(pr, sets, false);
  const std::vector<float> actual = dev.run();
  EXPECT_LE(rel_l2(actual, expected), 1e-5);
  EXPECT_TRUE(bitwise_equal(actual, dev.run()));
}

// The shared expert on its own stream then added by the routed call is bitwise the fused call, in every tile
// configuration, fp32 and bf16, with out-of-range ids; and the split is refused without (or with a stray) addend.
TEST_F(CudaMoeExperts, SplitSharedExpertIsBitwiseTheFusedCall) {
  {
    const ExpertSets sets(64, 32, 8, false, 13);
    for (const int64_t tokens : {1, 9, 37}) {
      Problem pr = random_problem(tokens, 2, 8, 64, 8, 1.5f, static_cast<uint32_t>(300 + tokens));
      pr.chosen[0] = -1;
      DeviceRun dev(pr, sets);
      EXPECT_TRUE(bitwise_equal(dev.run_split(), dev.run())) << "fp32, tokens " << tokens;
    }
  }
  const ExpertSets& sets = flash_sets();
  for (const int64_t tokens : {1, 5, 128, 700}) {
    const Problem pr = random_problem(tokens, 6, 256, sets.D, sets.routed_sets(), 2.0f,
                                      static_cast<uint32_t>(tokens * 11 + 3));
    DeviceRun dev(pr, sets);
    for (const int tile_rows : tokens == 128 ? std::vector<int>{0, 16, 64, 128} : std::vector<int>{0}) {
      const std::vector<float> split = dev.run_split(tile_rows);
      EXPECT_LE(rel_l2(split, reference(pr, sets, true)), 1e-2) << "tokens " << tokens;
      EXPECT_TRUE(bitwise_equal(split, dev.run(tile_rows))) << "bf16, tokens " << tokens << " tile_rows " << tile_rows;
    }
  }
  const Problem pr = random_problem(3, 6, 256, sets.D, sets.routed_sets(), 2.0f, 5);
  DeviceRun dev(pr, sets);
  MoeExpertsParams added = dev.params;
  added.shared = MoeSharedExpert::kAdded;
  EXPECT_EQ(moe_experts(added, dev.weights, dev.x, dev.chosen, dev.routing_weights, dev.out, dev.workspace,
                        dev.workspace_bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(moe_experts(dev.params, dev.weights, dev.x, dev.chosen, dev.routing_weights, dev.out, dev.workspace,
                        dev.workspace_bytes, nullptr, dev.x),
            cudaErrorInvalidValue);
}

TEST_F(CudaMoeExperts, Bf16MatchesCpuFlashShape) {
  const ExpertSets& sets = flash_sets();
  for (const int64_t tokens : {1, 5, 128, 700}) {
    const Problem pr = random_problem(tokens, 6, 256, sets.D, sets.routed_sets(), 2.0f,
                                      static_cast<uint32_t>(tokens * 7 + 1));
    DeviceRun dev(pr, sets);
    const std::vector<float> expected = reference(pr, sets, true);
    const std::vector<float> actual = dev.run();
    const double err = rel_l2(actual, expected);
    EXPECT_LE(err, 1e-2) << "tokens " << tokens;
    std::printf("bf16 V4-Flash shape, tokens %lld: rel L2 %.3g\n", static_cast<long long>(tokens), err);
    EXPECT_TRUE(bitwise_equal(actual, dev.run())) << "tokens " << tokens << ": not bitwise repeatable";
    if (tokens == 5 || tokens == 128)
      for (const int tile_rows : {16, 64, 128}) {
        const std::vector<float> forced = dev.run(tile_rows);
        EXPECT_LE(rel_l2(forced, expected), 1e-2) << "tokens " << tokens << " tile_rows " << tile_rows;
      }
  }
}

// kDeepSeek's expert order (MoeExpertsParams::deepseek) against a CPU reference built like
// DeepseekV4Model::moe_deepseek on the same (FP8-simulated) input: gate/up bf16, SwiGLU, × routing weight, bf16,
// e4m3 per 128, w2, bf16, summed. fp32 GEMMs on both sides in different orders, so a bf16 rounding that lands the
// other way can move an e4m3 code: the device must be within 2e-2 of it and closer to it than the kHf kernel is.
std::vector<float> deepseek_reference(const Problem& pr, const ExpertSets& sets) {
  const int64_t N = pr.tokens, K = pr.top_k, D = sets.D, I = sets.I;
  auto bf16 = [](std::vector<float>& v) {
    for (float& e : v) e = bf16_to_f32(f32_to_bf16(e));
  };
  std::vector<float> out(static_cast<size_t>(N * D), 0.0f);
  auto expert = [&](const std::vector<float>& rows, int64_t n, int set, const std::vector<float>& row_weights) {
    std::vector<float> gate_up(static_cast<size_t>(n * 2 * I)), activated(static_cast<size_t>(n * I));
    cpu::linear(rows.data(), n, D, sets.w13[set].data(), 2 * I, gate_up.data());
    bf16(gate_up);
    cpu::swiglu_clamped(gate_up.data(), n, I, pr.limit, activated.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < I; ++j) activated[i * I + j] *= row_weights[i];
    bf16(activated);
    for (int64_t i = 0; i < n; ++i) cpu::quantize_e4m3_blocks(&activated[i * I], I, 128);
    std::vector<float> y(static_cast<size_t>(n * D));
    cpu::linear(activated.data(), n, I, sets.w2[set].data(), D, y.data());
    bf16(y);
    return y;
  };
  for (int64_t t = 0; t < N; ++t)  // token by token, its experts in expert order (moe_deepseek's sum)
    for (int32_t e = 0; e < pr.experts; ++e)
      for (int64_t k = 0; k < K; ++k) {
        if (pr.chosen[t * K + k] != e) continue;
        const std::vector<float> row(pr.x.begin() + t * D, pr.x.begin() + (t + 1) * D);
        const std::vector<float> y = expert(row, 1, pr.expert_set[e], {pr.weights[t * K + k]});
        for (int64_t j = 0; j < D; ++j) out[t * D + j] += y[j];
      }
  const std::vector<float> shared = expert(pr.x, N, sets.routed_sets(), std::vector<float>(static_cast<size_t>(N), 1.0f));
  for (size_t i = 0; i < out.size(); ++i) out[i] += shared[i];
  return out;
}

TEST_F(CudaMoeExperts, DeepSeekOrderTracksItsCpuRecipe) {
  static const ExpertSets sets(1024, 512, 4, true, 77);
  for (const int64_t tokens : {1, 5, 130}) {
    Problem pr = random_problem(tokens, 6, 16, sets.D, sets.routed_sets(), 10.0f, static_cast<uint32_t>(tokens + 90));
    for (float& v : pr.x) v = bf16_to_f32(f32_to_bf16(v));
    for (int64_t t = 0; t < tokens; ++t) cpu::quantize_e4m3_blocks(&pr.x[t * sets.D], sets.D, 128);
    const std::vector<float> expected = deepseek_reference(pr, sets);
    DeviceRun dev(pr, sets);
    const std::vector<float> plain = dev.run();
    dev.params.deepseek = true;  // its workspace holds the rows' routing weights too
    cudaFree(dev.workspace);
    dev.workspace_bytes = moe_experts_workspace_bytes(dev.params);
    ASSERT_EQ(cudaMalloc(&dev.workspace, dev.workspace_bytes), cudaSuccess);
    const std::vector<float> actual = dev.run();
    const double err = rel_l2(actual, expected), plain_err = rel_l2(plain, expected);
    std::printf("deepseek order, tokens %lld: rel L2 %.3g to its recipe (the kHf kernel: %.3g)\n",
                static_cast<long long>(tokens), err, plain_err);
    EXPECT_LE(err, 2e-2) << "tokens " << tokens;
    EXPECT_LT(err, plain_err) << "tokens " << tokens;
    EXPECT_TRUE(bitwise_equal(actual, dev.run())) << "tokens " << tokens << ": not bitwise repeatable";
    const std::vector<float> split = dev.run_split();
    EXPECT_TRUE(bitwise_equal(actual, split)) << "tokens " << tokens << ": the split shared expert differs";
  }
}

TEST_F(CudaMoeExperts, Bf16HotAndNeverChosenExperts) {
  // E = 16 (the test model): expert 3 chosen by all 300 tokens (several row tiles in every configuration),
  // experts 8..15 by none.
  const ExpertSets& sets = flash_sets();
  Problem pr = random_problem(300, 6, 16, sets.D, sets.routed_sets(), 2.0f, 77);
  std::mt19937 rng(78);
  std::vector<int32_t> others = {0, 1, 2, 4, 5, 6, 7};
  for (int64_t t = 0; t < pr.tokens; ++t) {
    std::shuffle(others.begin(), others.end(), rng);
    pr.chosen[t * 6] = 3;
    for (int k = 1; k < 6; ++k) pr.chosen[t * 6 + k] = others[k - 1];
  }
  DeviceRun dev(pr, sets);
  const std::vector<float> expected = reference(pr, sets, true);
  for (const int tile_rows : {0, 16, 64, 128}) {
    const std::vector<float> actual = dev.run(tile_rows);
    EXPECT_LE(rel_l2(actual, expected), 1e-2) << "tile_rows " << tile_rows;
    EXPECT_TRUE(bitwise_equal(actual, dev.run(tile_rows))) << "tile_rows " << tile_rows;
  }
}

TEST_F(CudaMoeExperts, Bf16GraphReplayFollowsDeviceRouting) {
  const ExpertSets& sets = flash_sets();
  const Problem a = random_problem(8, 6, 256, sets.D, sets.routed_sets(), 2.0f, 501);
  Problem b = random_problem(8, 6, 256, sets.D, sets.routed_sets(), 2.0f, 502);
  b.x = a.x;  // same inputs, new routing
  DeviceRun dev(a, sets);
  const std::vector<float> eager_a = dev.run();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t captured = dev.launch(stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(captured);
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<float> replay(eager_a.size());
  CUDA_OK(cudaMemset(dev.out, 0xff, replay.size() * 4));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaMemcpy(replay.data(), dev.out, replay.size() * 4, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(bitwise_equal(replay, eager_a));
  // New routing written on the device; the same graph must follow it.
  CUDA_OK(cudaMemcpy(dev.chosen, b.chosen.data(), b.chosen.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dev.routing_weights, b.weights.data(), b.weights.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dev.out, 0xff, replay.size() * 4));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaMemcpy(replay.data(), dev.out, replay.size() * 4, cudaMemcpyDeviceToHost));
  const std::vector<float> eager_b = dev.run();
  EXPECT_TRUE(bitwise_equal(replay, eager_b));
  EXPECT_LE(rel_l2(replay, reference(b, sets, true)), 1e-2);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Routed experts in a grouped low-bit format, decoded in the kernel: MXFP4 (random packed e2m1 codes and
// UE8M0 scales per 32 inputs, decoded by the naive formula below) and kQ3G32 / kQ2G32 (random dense experts
// requantized by LinearWeight, as --expert-bits does). The bf16 mode over the same weights decoded on the
// host to bf16 is the reference: the kernel's decode is exact (MXFP4) or rounds (c − offset)·s to bf16 once
// (Q3 / Q2), as the upload does, and the mma order is the same, so the results must be bitwise equal at every
// tile configuration; and track the CPU reference.
struct GroupedExpertSets {
  int bits = 4;
  int64_t D = 0, I = 0;
  ExpertSets decoded;  // bf16 device copies + the fp32 values (the reference)
  std::vector<void*> device_codes13, device_codes2, device_scales13, device_scales2;  // routed sets only

  static float e2m1(uint8_t nibble) {
    static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return (nibble & 8 ? -1.0f : 1.0f) * kMagnitude[nibble & 7];
  }
  // Random codes [rows, cols / 2] and exponents [rows, cols / 32] around 2^-5 (so |w| ≲ 0.2); fp32 values
  // out.
  static std::vector<float> random_fp4(int64_t rows, int64_t cols, std::mt19937& rng,
                                       std::vector<uint8_t>& codes, std::vector<uint8_t>& exponents) {
    codes.resize(static_cast<size_t>(rows * cols / 2));
    exponents.resize(static_cast<size_t>(rows * cols / 32));
    for (auto& c : codes) c = static_cast<uint8_t>(rng());
    for (auto& e : exponents) e = static_cast<uint8_t>(127 - 8 + rng() % 5);
    // A few groups at the ends of the kernel's range: scale 2^-127 (e 0, subnormal products) and 2 (e 128).
    for (size_t i = 7; i < exponents.size(); i += 101) exponents[i] = i % 2 == 0 ? 0 : 128;
    std::vector<float> values(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t byte = codes[static_cast<size_t>((r * cols + c) / 2)];
        const uint8_t nibble = c % 2 == 0 ? byte & 15 : byte >> 4;
        values[static_cast<size_t>(r * cols + c)] =
            std::ldexp(e2m1(nibble), exponents[static_cast<size_t>(r * (cols / 32) + c / 32)] - 127);
      }
    return values;
  }
  static void* upload_bytes(const std::vector<uint8_t>& bytes) {
    void* d = nullptr;
    if (cudaMalloc(&d, bytes.size()) != cudaSuccess) return nullptr;
    cudaMemcpy(d, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
    return d;
  }
  // One routed matrix: its kernel codes and scales on the device, its fp32 values back.
  std::vector<float> make(int64_t rows, int64_t cols, std::mt19937& rng, std::vector<void*>& codes_out,
                          std::vector<void*>& scales_out) {
    if (bits == 4) {
      std::vector<uint8_t> codes, exponents;
      std::vector<float> values = random_fp4(rows, cols, rng, codes, exponents);
      codes_out.push_back(upload_bytes(moe_kernel_codes(4, rows, cols, codes.data())));
      scales_out.push_back(upload_bytes(mxfp4_tile_scales(rows, cols, exponents.data())));
      return values;
    }
    Tensor dense({rows, cols});
    const float scale = 2.5f / std::sqrt(static_cast<float>(cols));
    for (float& v : dense.data) v = scale * uniform(rng);
    const LinearWeight q = LinearWeight(std::move(dense))
                               .requantized(bits == 3 ? WeightEncoding::kQ3G32 : WeightEncoding::kQ2G32);
    codes_out.push_back(upload_bytes(moe_kernel_codes(bits, rows, cols, q.codes().data())));
    scales_out.push_back(upload_bytes(grouped_tile_scales(rows, cols, q.group_scales().data())));
    EXPECT_TRUE(grouped_kernel_scales_supported(q.group_scales().size(), q.group_scales().data()));
    return q.dequantized().data;
  }

  GroupedExpertSets(int code_bits, int64_t d, int64_t i, int sets, uint32_t seed)
      : bits(code_bits), D(d), I(i), decoded(d, i, sets, true, seed) {
    std::mt19937 rng(seed + 1);
    for (int s = 0; s < sets; ++s) {  // the routed sets become grouped; the shared expert stays bf16
      decoded.w13[s] = make(2 * I, D, rng, device_codes13, device_scales13);
      decoded.w2[s] = make(D, I, rng, device_codes2, device_scales2);
      cudaFree(decoded.device_w13[s]);
      cudaFree(decoded.device_w2[s]);
      decoded.device_w13[s] = decoded.upload(decoded.w13[s]);  // bf16 round to nearest, as the model's upload
      decoded.device_w2[s] = decoded.upload(decoded.w2[s]);
    }
  }
  GroupedExpertSets(const GroupedExpertSets&) = delete;
  GroupedExpertSets& operator=(const GroupedExpertSets&) = delete;
  ~GroupedExpertSets() {
    for (auto* list : {&device_codes13, &device_codes2, &device_scales13, &device_scales2})
      for (void* p : *list) cudaFree(p);
  }
  MoeWeightDtype dtype() const {
    return bits == 4 ? MoeWeightDtype::kMxfp4 : bits == 3 ? MoeWeightDtype::kQ3G32 : MoeWeightDtype::kQ2G32;
  }
};

// Points a DeviceRun built on the decoded bf16 sets at the grouped codes and scales instead.
struct GroupedTables {
  const void** tables[4] = {nullptr, nullptr, nullptr, nullptr};
  GroupedTables(DeviceRun& dev, const Problem& pr, const GroupedExpertSets& sets) {
    const std::vector<void*>* sources[4] = {&sets.device_codes13, &sets.device_codes2, &sets.device_scales13,
                                            &sets.device_scales2};
    for (int k = 0; k < 4; ++k) {
      std::vector<const void*> host(static_cast<size_t>(pr.experts));
      for (int64_t e = 0; e < pr.experts; ++e) host[e] = (*sources[k])[pr.expert_set[e]];
      cudaMalloc(reinterpret_cast<void**>(&tables[k]), host.size() * sizeof(void*));
      cudaMemcpy(tables[k], host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice);
    }
    dev.params.dtype = sets.dtype();
    dev.weights.w13 = tables[0];
    dev.weights.w2 = tables[1];
    dev.weights.w13_scales = tables[2];
    dev.weights.w2_scales = tables[3];
  }
  GroupedTables(const GroupedTables&) = delete;
  GroupedTables& operator=(const GroupedTables&) = delete;
  ~GroupedTables() {
    for (const void** t : tables) cudaFree(t);
  }
};

void expect_grouped_equals_bf16(const GroupedExpertSets& sets, int64_t tokens, int64_t experts,
                                uint32_t seed) {
  const Problem pr = random_problem(tokens, 6, experts, sets.D, sets.decoded.routed_sets(), 2.0f, seed);
  const std::vector<float> expected = reference(pr, sets.decoded, true);
  DeviceRun bf16_run(pr, sets.decoded);
  DeviceRun grouped_run(pr, sets.decoded);
  const GroupedTables tables(grouped_run, pr, sets);
  for (const int tile_rows : {0, 16, 64, 128}) {
    const std::vector<float> want = bf16_run.run(tile_rows);
    const std::vector<float> got = grouped_run.run(tile_rows);
    EXPECT_TRUE(bitwise_equal(got, want))
        << sets.bits << "-bit codes, D " << sets.D << " tokens " << tokens << " tile_rows " << tile_rows
        << ": rel L2 to the bf16 mode " << rel_l2(got, want);
    EXPECT_LE(rel_l2(got, expected), 1e-2) << "tokens " << tokens << " tile_rows " << tile_rows;
    if (tile_rows == 0) {
      EXPECT_TRUE(bitwise_equal(got, grouped_run.run(0))) << "not bitwise repeatable";
    }
  }
}

TEST_F(CudaMoeExperts, Mxfp4EqualsBf16OnDecodedWeightsFlashShape) {
  const GroupedExpertSets sets(4, 4096, 2048, 4, 4242);
  for (const int64_t tokens : {1, 7, 130}) expect_grouped_equals_bf16(sets, tokens, 256, 900 + tokens);
  expect_grouped_equals_bf16(sets, 300, 16, 917);  // dozens of rows per expert
}

TEST_F(CudaMoeExperts, ThreeAndTwoBitExpertsEqualBf16OnDecodedWeightsFlashShape) {
  for (const int bits : {3, 2}) {
    const GroupedExpertSets sets(bits, 4096, 2048, 3, 4300 + bits);
    for (const int64_t tokens : {1, 130}) expect_grouped_equals_bf16(sets, tokens, 256, 930 + tokens + bits);
  }
}

TEST_F(CudaMoeExperts, GroupedHalfKTilesAndRaggedColumns) {
  // D 160 and I 96: both end in a 32-wide half k tile; the column counts are not multiples of a CTA's tile.
  for (const int bits : {4, 3, 2}) {
    const GroupedExpertSets sets(bits, 160, 96, 4, 4343 + bits);
    for (const int64_t tokens : {1, 9, 64}) expect_grouped_equals_bf16(sets, tokens, 8, 950 + tokens + bits);
  }
}

TEST_F(CudaMoeExperts, GroupedRefusesWidthsOffTheScaleGroups) {
  const GroupedExpertSets sets(4, 160, 96, 2, 4444);
  const Problem pr = random_problem(4, 6, 8, sets.D, sets.decoded.routed_sets(), 2.0f, 4445);
  DeviceRun dev(pr, sets.decoded);
  const GroupedTables tables(dev, pr, sets);
  dev.params.intermediate = 88;  // a multiple of 8, not of 32
  EXPECT_EQ(dev.launch(), cudaErrorInvalidValue);
  dev.params.intermediate = 96;
  dev.weights.w2_scales = nullptr;
  EXPECT_EQ(dev.launch(), cudaErrorInvalidValue);
}

// The fragment order of moe_kernel_codes, read back by the documented bit positions.
// Packs code_of(r, k) as stored (MXFP4: two nibbles per byte; Q: a little-endian bit stream per row and group,
// rows·cols·bits/8 bytes), rearranges it, and counts the codes that the fragment-order read-back misplaces.
template <typename CodeOf>
int64_t misplaced_codes(int bits, int64_t rows, int64_t cols, const CodeOf& code_of) {
  std::vector<uint8_t> stored(static_cast<size_t>(rows * cols * bits / 8), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) {
      const uint32_t c = code_of(r, k);
      const int64_t bit = (r * cols + k) * bits;
      stored[static_cast<size_t>(bit / 8)] |= static_cast<uint8_t>(c << (bit % 8));
      if (bit % 8 + bits > 8) stored[static_cast<size_t>(bit / 8 + 1)] |= static_cast<uint8_t>(c >> (8 - bit % 8));
    }
  const std::vector<uint8_t> ordered = moe_kernel_codes(bits, rows, cols, stored.data());
  const int row_bytes = bits == 4 ? 32 : bits == 3 ? 24 : 16;
  const int64_t tiles = (cols + 63) / 64;
  EXPECT_EQ(ordered.size(), moe_kernel_code_bytes(bits, rows, cols));
  if (ordered.size() != static_cast<size_t>(tiles * rows * row_bytes)) return -1;
  auto word = [&](int64_t offset, int bytes) {
    uint32_t w = 0;
    for (int b = 0; b < bytes; ++b) w |= static_cast<uint32_t>(ordered[static_cast<size_t>(offset + b)]) << (8 * b);
    return w;
  };
  int64_t wrong = 0;
  for (int64_t tile = 0; tile < tiles; ++tile)
    for (int64_t r = 0; r < rows; ++r)
      for (int t = 0; t < 4; ++t)
        for (int g = 0; g < 2; ++g)
          for (int i = 0; i < 4; ++i)
            for (int half = 0; half < 2; ++half) {
              const int64_t k = tile * 64 + g * 32 + 8 * i + 2 * t + half;
              const uint32_t want = k < cols ? code_of(r, k) : 0u;
              const int64_t base = (tile * rows + r) * row_bytes;
              uint32_t got = 0;
              if (bits == 4) {
                got = (word(base + 8 * t + 4 * g, 4) >> (12 - 4 * i + 16 * half)) & 15;
              } else {
                got = (word(base + 4 * t, 4) >> (8 * g + 2 * i + 16 * half)) & 3;
                if (bits == 3) got |= ((word(base + 16 + 2 * t, 2) >> (4 * g + i + 8 * half)) & 1) << 2;
              }
              wrong += got != want;
            }
  return wrong;
}

TEST(MoeKernelLayout, CodesAndScalesLandWhereTheFragmentsReadThem) {
  for (const int bits : {4, 3, 2}) {
    const uint32_t mask = (1u << bits) - 1;
    // [3, 96] (one whole k tile + a half one): input k of row r carries code (k + r) mod 2^bits.
    EXPECT_EQ(misplaced_codes(bits, 3, 96, [&](int64_t r, int64_t k) { return static_cast<uint32_t>(k + r) & mask; }),
              0)
        << bits << "-bit codes";
    // [40, 224] (three and a half tiles), random codes.
    std::vector<uint32_t> random(40 * 224);
    std::mt19937 rng(static_cast<uint32_t>(bits));
    for (uint32_t& c : random) c = rng() & mask;
    EXPECT_EQ(misplaced_codes(bits, 40, 224, [&](int64_t r, int64_t k) { return random[r * 224 + k]; }), 0)
        << bits << "-bit random codes";
  }
  // Scales: [rows 2, 3 groups] -> [tile][row][2], the missing 4th group 0.
  const std::vector<uint8_t> exponents = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(mxfp4_tile_scales(2, 96, exponents.data()), (std::vector<uint8_t>{1, 2, 4, 5, 3, 0, 6, 0}));
  const std::vector<uint16_t> bf16_scales = {0x3c01, 0x3c02, 0x3c03, 0x3c04, 0x3c05, 0x3c06};
  EXPECT_EQ(grouped_tile_scales(2, 96, bf16_scales.data()),
            (std::vector<uint8_t>{1, 0x3c, 2, 0x3c, 4, 0x3c, 5, 0x3c, 3, 0x3c, 0, 0, 6, 0x3c, 0, 0}));
  EXPECT_TRUE(mxfp4_kernel_scales_supported(exponents.size(), exponents.data()));
  const std::vector<uint8_t> too_large = {127, 128, 129};
  EXPECT_FALSE(mxfp4_kernel_scales_supported(too_large.size(), too_large.data()));
  EXPECT_TRUE(grouped_kernel_scales_supported(bf16_scales.size(), bf16_scales.data()));
  const std::vector<uint16_t> tiny = {0x3c00, 0x0001};  // a subnormal scale
  EXPECT_FALSE(grouped_kernel_scales_supported(tiny.size(), tiny.data()));
}

}  // namespace
}  // namespace dsv4::ops::cuda
