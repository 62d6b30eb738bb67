// The CUDA sparse attention decode (ops/cuda/sparse_attention.h) against its CPU twin on random problems at the
// production shapes and corners, BF16 and FP8 caches, unsplit and split-K; poisoned outputs, bitwise repeats.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "device_problem.h"
#include "ops/cpu/sparse_attention.h"
#include "ops/cuda/device.h"
#include "ops/cuda/sparse_attention.h"

namespace dsv4::testing {
namespace {

class CudaSparseAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    if (ops::cuda::list_devices().empty()) GTEST_SKIP() << "no CUDA device";
  }
};

int multiprocessors() { return ops::cuda::list_devices().front().multiprocessors; }

std::vector<uint16_t> run_gpu(DeviceProblem& dev, const ops::SparseAttentionParams& p) {
  dev.reserve_workspace(ops::cuda::sparse_attention_workspace_bytes(p, multiprocessors()));
  DSV4_CUDA_OK(cudaMemset(dev.out, 0xff, dev.out_elements * sizeof(uint16_t)));  // poison: bf16 NaN
  EXPECT_EQ(ops::cuda::sparse_attention(p, dev.q, dev.out, dev.workspace, dev.workspace_bytes, nullptr), cudaSuccess);
  DSV4_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(dev.out_elements);
  DSV4_CUDA_OK(cudaMemcpy(out.data(), dev.out, out.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  return out;
}

// Relative L2 of the GPU output against the twin, each token on its own (a token with all-zero output must be
// exactly zero) and overall; every element written.
void expect_close(const std::vector<uint16_t>& gpu, const std::vector<uint16_t>& twin, int64_t tokens,
                  const std::string& what) {
  const size_t per_token = gpu.size() / static_cast<size_t>(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    double err = 0, norm = 0;
    for (size_t i = t * per_token; i < (t + 1) * per_token; ++i) {
      const double a = bf16_to_f32(gpu[i]), b = bf16_to_f32(twin[i]);
      ASSERT_FALSE(std::isnan(a)) << what << ": unwritten or NaN at " << i;
      err += (a - b) * (a - b);
      norm += b * b;
    }
    if (norm == 0) {
      EXPECT_EQ(err, 0) << what << " token " << t;
    } else {
      // bf16 operands and bf16 probabilities in P·V (the reference kernel's rounding): ~2e-3 expected.
      EXPECT_LE(std::sqrt(err / norm), 1e-2) << what << " token " << t;
    }
  }
}

void check(AttentionProblem pr, const std::string& what, std::vector<int64_t> forced_splits = {}) {
  DeviceProblem dev(pr);
  ops::SparseAttentionParams p = dev.params(pr);
  std::vector<uint16_t> twin(pr.q.size(), 0xffff);
  ops::cpu::sparse_attention(pr.host_params(), pr.q.data(), twin.data());
  forced_splits.insert(forced_splits.begin(), 0);  // 0: the kernel's own choice
  // Both kernels: the warpgroup-MMA one (the default) and the mma.sync one (DSV4_ATTENTION_KERNEL=mma).
  for (const char* kernel : {"wgmma", "mma"}) {
    ::setenv("DSV4_ATTENTION_KERNEL", kernel, 1);
    for (const int64_t splits : forced_splits) {
      p.num_splits = splits;
      const std::string label =
          what + " [" + kernel + "]" +
          (splits ? " splits=" + std::to_string(splits)
                  : " auto splits=" + std::to_string(ops::cuda::sparse_attention_splits(p, multiprocessors())));
      const std::vector<uint16_t> gpu = run_gpu(dev, p);
      expect_close(gpu, twin, pr.tokens(), label);
      EXPECT_EQ(gpu, run_gpu(dev, p)) << label << ": not bitwise repeatable";
    }
  }
  ::unsetenv("DSV4_ATTENTION_KERNEL");
  if (!pr.rows.empty()) {
    // A prefill: where its (token, head group) items exceed two waves the persistent prefill kernel runs (on a
    // Hopper, BF16 and FP8 keys), and it must be bitwise the one-CTA-an-item kernel (DSV4_ATTENTION_PREFILL=0).
    p.num_splits = 0;
    const std::vector<uint16_t> by_default = run_gpu(dev, p);
    ::setenv("DSV4_ATTENTION_PREFILL", "0", 1);
    const std::vector<uint16_t> one_cta_an_item = run_gpu(dev, p);
    ::unsetenv("DSV4_ATTENTION_PREFILL");
    EXPECT_EQ(by_default, one_cta_an_item) << what << ": the persistent prefill kernel differs";
  }
}
void check(const AttentionProblemSpec& spec, const std::string& what, std::vector<int64_t> forced_splits = {}) {
  AttentionProblemSpec s = spec;
  s.keep_reference = false;
  check(make_attention_problem(s), what, std::move(forced_splits));
}

TEST_F(CudaSparseAttention, FlashCsaTopK512) {
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16}) {
    AttentionProblemSpec spec;
    spec.format = format;
    spec.positions = {8191, 131071, 515, 63, 1000003};
    check(spec, format == KvEntryFormat::kFp8 ? "flash csa fp8" : "flash csa bf16", {1, 3, 10});
  }
}

TEST_F(CudaSparseAttention, FlashCsaBatch32) {
  AttentionProblemSpec spec;
  for (int i = 0; i < 32; ++i) spec.positions.push_back(8192 + 977 * i);
  check(spec, "flash csa batch 32", {1});
}

TEST_F(CudaSparseAttention, ProCsaTopK1024) {
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16}) {
    AttentionProblemSpec spec;
    spec.heads = 128;
    spec.top_k = 1024;
    spec.format = format;
    spec.positions = {131071, 5000, 700};
    check(spec, "pro csa", {1, 5});
  }
}

TEST_F(CudaSparseAttention, HcaEveryEntry) {
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16}) {
    AttentionProblemSpec spec;
    spec.ratio = 128;
    spec.format = format;
    spec.compressed_entries_per_block = 2;
    spec.positions = {1048575, 300, 126, 131071};  // 8192 entries; 2; none; 1024
    check(spec, "hca", {1, 2, 7, 64});
  }
}

TEST_F(CudaSparseAttention, PrefillChunkKeys) {
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16})
    for (const int64_t ratio : {int64_t{4}, int64_t{128}, int64_t{0}}) {
      AttentionProblemSpec spec;
      spec.format = format;
      spec.ratio = ratio;
      spec.compressed_entries_per_block = ratio == 128 ? 2 : 64;
      spec.prefill_chunk = 200;
      for (int i = 0; i < 40; ++i) spec.positions.push_back(16000 + 37 * i);
      spec.positions.push_back(3);
      check(spec, "prefill ratio " + std::to_string(ratio), {1, 4});
    }
}

TEST_F(CudaSparseAttention, PrefillOfOneRequest) {
  // The runner's prefill layout (one block-table row, consecutive positions, shared chunk and compressed entries):
  // a chunk from position 0 and one from 2,100 whose CSA queries see 525-675 entries (random top-512 picks) and
  // whose window straddles the paged window and the chunk.
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16})
    for (const int64_t ratio : {int64_t{4}, int64_t{128}, int64_t{0}})
      for (const auto& [first, tokens] : {std::pair<int64_t, int64_t>{0, 200}, {2100, 600}}) {
        AttentionProblemSpec spec;
        spec.format = format;
        spec.ratio = ratio;
        spec.compressed_entries_per_block = ratio == 128 ? 2 : 64;
        spec.keep_reference = false;
        spec.seed = static_cast<uint32_t>(ratio * 7 + first);
        check(make_prefill_problem(spec, first, tokens),
              "prefill ratio " + std::to_string(ratio) + " from " + std::to_string(first) +
                  (format == KvEntryFormat::kFp8 ? " fp8" : " bf16"));
      }
}

TEST_F(CudaSparseAttention, CornerCases) {
  AttentionProblemSpec spec;
  spec.invalid_fraction = 0.3;
  spec.positions = {0, 1, 2, 130, 4099, 201, 64};  // 1-key window, lengths not multiples of 4, straddles
  check(spec, "invalid picks", {1, 4});
  spec.invalid_fraction = 1.0;
  check(spec, "no valid compressed entry", {1, 2});
  spec.ratio = 0;
  check(spec, "swa only", {1, 2});
  spec.ratio = 4;
  spec.invalid_fraction = 0.0;
  spec.format = KvEntryFormat::kBf16;
  spec.sink_max = 40.0f;  // sinks that dominate the denominator
  check(spec, "large sinks bf16", {3});
}

}  // namespace
}  // namespace dsv4::testing
