// The routed + shared MoE experts on the device (ops/cuda/moe_experts.h) against a CPU reference built like the
// kHf loop of DeepseekV4Model::moe (ops/cpu/linear.h + ops/cpu/moe.h swiglu_clamped): fp32 mode at a tiny shape
// to 1e-5, bf16 mode at the V4-Flash expert shape (D 4096, I 2048, top-k 6) against the reference fed with the
// bf16-rounded weights and inputs, every tile configuration, hot and never-chosen experts, out-of-range ids,
// bitwise repeats and a CUDA-graph replay. Outputs and workspaces are poisoned before every call. Skips
// without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cuda/device.h"
#include "ops/cuda/moe_experts.h"

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

}  // namespace
}  // namespace dsv4::ops::cuda
