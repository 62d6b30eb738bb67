// ops/cuda/l2_prefetch: the budget arithmetic of L2PrefetchParams::add (host only, runs everywhere), and on a GPU
// that prefetching ranges of every kind of size runs, refuses what it cannot take, and changes nothing it reads.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "ops/cuda/device.h"
#include "ops/cuda/l2_prefetch.h"

namespace dsv4::ops::cuda {
namespace {

TEST(L2PrefetchParams, AddTakesRangesInOrderWithinTheBudget) {
  alignas(16) static char memory[4096];
  size_t budget = 1000;
  L2PrefetchParams p;
  EXPECT_EQ(p.add(memory, 300, budget), 288u);  // whole 16-byte units only
  EXPECT_EQ(budget, 712u);
  EXPECT_EQ(p.add(nullptr, 300, budget), 0u);  // a missing weight takes nothing
  EXPECT_EQ(p.add(memory + 512, 2000, budget), 704u);  // the rest of the budget, rounded down
  EXPECT_EQ(budget, 8u);
  EXPECT_EQ(p.add(memory + 1024, 64, budget), 0u);  // less than 16 bytes left
  ASSERT_EQ(p.count, 2);
  EXPECT_EQ(p.ranges[0].data, memory);
  EXPECT_EQ(p.ranges[1].data, memory + 512);
  EXPECT_EQ(p.ranges[1].bytes, 704u);
  EXPECT_TRUE(l2_prefetch_supported(p));
  size_t plenty = 1 << 20;
  L2PrefetchParams full;
  for (int r = 0; r < kL2PrefetchMaxRanges; ++r) EXPECT_EQ(full.add(memory, 16, plenty), 16u);
  EXPECT_EQ(full.add(memory, 16, plenty), 0u);  // no slot left
  EXPECT_EQ(full.count, kL2PrefetchMaxRanges);
}

TEST(L2PrefetchParams, RefusesMisalignedOrRaggedRanges) {
  alignas(16) static char memory[256];
  L2PrefetchParams p;
  p.count = 1;
  p.ranges[0] = {memory + 8, 64};
  EXPECT_FALSE(l2_prefetch_supported(p));
  p.ranges[0] = {memory, 40};
  EXPECT_FALSE(l2_prefetch_supported(p));
  p.ranges[0] = {nullptr, 64};
  EXPECT_FALSE(l2_prefetch_supported(p));
  p.count = kL2PrefetchMaxRanges + 1;
  EXPECT_FALSE(l2_prefetch_supported(p));
  p.count = 1;
  p.ranges[0] = {memory, 0};  // an empty range is skipped
  EXPECT_TRUE(l2_prefetch_supported(p));
}

TEST(CudaL2Prefetch, RunsOverRangesOfEverySizeAndLeavesTheDataAsItWas) {
  if (list_devices().empty()) GTEST_SKIP() << "no CUDA device";
  const size_t bytes = (size_t{24} << 20) + 4096;  // not a whole number of the kernel's 16 KB chunks
  std::vector<uint32_t> host(bytes / 4);
  std::mt19937 rng(5);
  for (auto& v : host) v = rng();
  char* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(device, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  size_t budget = bytes;
  L2PrefetchParams p;
  p.add(device + 16, 48, budget);                 // smaller than a chunk
  p.add(device + 4096, (size_t{16} << 20) + 16, budget);  // a chunk and 16 bytes over
  p.add(device + (size_t{17} << 20), size_t{7} << 20, budget);  // runs to the end with what is left
  EXPECT_EQ(p.count, 3);
  EXPECT_EQ(prefetch_to_l2(p, stream), cudaSuccess);
  EXPECT_EQ(prefetch_to_l2(L2PrefetchParams{}, stream), cudaSuccess);  // nothing to do
  L2PrefetchParams misaligned;
  misaligned.count = 1;
  misaligned.ranges[0] = {device + 4, 64};
  EXPECT_EQ(prefetch_to_l2(misaligned, stream), cudaErrorInvalidValue);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the refusal launched nothing and left no error behind
  std::vector<uint32_t> back(host.size());
  ASSERT_EQ(cudaMemcpy(back.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(0, std::memcmp(back.data(), host.data(), bytes));
  cudaStreamDestroy(stream);
  cudaFree(device);
}

}  // namespace
}  // namespace dsv4::ops::cuda
