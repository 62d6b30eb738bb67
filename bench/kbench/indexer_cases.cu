// kbench suite "indexer": lightning-indexer scores over the paged FP8/BF16 index keys and the top-k at V4-Flash
// shapes (64 heads × 128, k 512 / 1024): 8K / 128K / 1M-token contexts = 2,048 / 32,768 / 262,144 compressed
// entries, decode batches 1 / 32 / 128 (64 too for top-k, the torch.topk comparison in bench/kbench/torch_topk.py).
// Each decode token has its own request, so every key is read once per call: bytes = keys + scores written.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kbench.h"
#include "ops/cuda/indexer_scores.h"
#include "ops/cuda/top_k.h"

namespace dsv4::kbench {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "indexer_cases: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

__device__ uint32_t hash(uint64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u ^ seed;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Random finite bytes everywhere (e4m3 NaN codes 0x7f/0xff replaced); the FP8 scales are overwritten after.
__global__ void fill_bytes(unsigned char* out, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    unsigned char b = static_cast<unsigned char>(hash(i, seed));
    if ((b & 0x7f) == 0x7f) b ^= 0x08;
    if ((b & 0x78) == 0x78) b &= 0xbf;  // |x| < 2^8: keeps bf16 and e4m3 values moderate
    out[i] = b;
  }
}
// FP8 scales: 2^-6 .. 2^-3 at each entry's scale slot of the bench layout.
__global__ void fill_scales(unsigned char* pool, IndexKeyPagedLayout layout, int64_t blocks) {
  const int64_t total = blocks * layout.entries_per_block;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const auto block = static_cast<int32_t>(i / layout.entries_per_block);
    const auto e = static_cast<int32_t>(i % layout.entries_per_block);
    *reinterpret_cast<float*>(pool + layout.scale_offset(block, e)) = ldexpf(1.0f, -3 - int(hash(i, 7) % 4));
  }
}
// Scores ~ N(0, 1) by Box-Muller on hashed uniforms (real indexer scores are dense reals too).
__global__ void fill_normal(float* out, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float u1 = (hash(i, seed) + 1.0f) * 0x1p-32f, u2 = hash(i, seed ^ 0x5bd1e995u) * 0x1p-32f;
    out[i] = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
  }
}
__global__ void fill_bf16(__nv_bfloat16* out, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = __float2bfloat16(hash(i, seed) * 0x1p-31f - 1.0f);
}

template <typename T>
T* device_alloc(size_t n) {
  T* p = nullptr;
  check(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  return p;
}

std::string shape_name(const char* what, int64_t entries, int64_t batch) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s %lldK b%lld", what, static_cast<long long>(entries / 1024),
                static_cast<long long>(batch));
  return buf;
}

std::vector<CaseResult> score_cases(const Ceilings&, const Options& options) {
  std::vector<CaseResult> results;
  const std::vector<int64_t> contexts = {2048, 32768, 262144};
  const std::vector<int64_t> batches = options.quick ? std::vector<int64_t>{1, 32} : std::vector<int64_t>{1, 32, 128};
  const int64_t max_tokens = batches.back();
  const int iterations = options.quick ? 5 : 20;
  for (const IndexKeyDtype dtype : {IndexKeyDtype::kFp8, IndexKeyDtype::kBf16}) {
    // The pool: blocks of 64 entries of 2 layers, this layer second, block ids shuffled (so the layer's 64-entry
    // runs are scattered as in the real c4_index group of 21 layers). One pool, big enough for the largest case.
    IndexKeyPagedLayout layout;
    layout.dtype = dtype;
    layout.layer_slot = 1;
    layout.block_bytes = 2 * 64 * layout.entry_bytes();
    layout.max_blocks_per_page = 512;
    layout.page_bytes = layout.max_blocks_per_page * layout.block_bytes;
    const int64_t max_context = options.quick ? 32768 : contexts.back();
    const int64_t blocks_per_request = max_context / 64;
    const int64_t blocks = blocks_per_request * max_tokens;
    const int64_t pages = (blocks + layout.max_blocks_per_page - 1) / layout.max_blocks_per_page;
    const size_t pool_bytes = static_cast<size_t>(pages * layout.page_bytes);
    auto* pool = device_alloc<unsigned char>(pool_bytes);
    fill_bytes<<<4096, 256>>>(pool, pool_bytes, 11);
    if (dtype == IndexKeyDtype::kFp8) fill_scales<<<4096, 256>>>(pool, layout, pages * layout.max_blocks_per_page);
    check(cudaGetLastError(), "pool fill");
    std::vector<int32_t> ids(static_cast<size_t>(pages * layout.max_blocks_per_page));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
    ids.resize(static_cast<size_t>(blocks));
    auto* tables = device_alloc<int32_t>(ids.size());
    check(cudaMemcpy(tables, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "tables");
    auto* q = device_alloc<__nv_bfloat16>(max_tokens * 64 * 128);
    fill_bf16<<<256, 256>>>(q, max_tokens * 64 * 128, 3);
    auto* weights = device_alloc<float>(max_tokens * 64);
    fill_normal<<<64, 256>>>(weights, max_tokens * 64, 4);
    std::vector<int32_t> requests(max_tokens);
    std::iota(requests.begin(), requests.end(), 0);
    auto* token_request = device_alloc<int32_t>(max_tokens);
    check(cudaMemcpy(token_request, requests.data(), max_tokens * 4, cudaMemcpyHostToDevice), "requests");
    auto* entries = device_alloc<int32_t>(max_tokens);
    auto* positions = device_alloc<int32_t>(max_tokens);
    auto* scores = device_alloc<float>(max_tokens * max_context);
    for (const int64_t context : contexts) {
      if (context > max_context) continue;
      std::vector<int32_t> host_entries(max_tokens, static_cast<int32_t>(context));
      std::vector<int32_t> host_positions(max_tokens, static_cast<int32_t>(4 * context + 3));  // decode: all seen
      check(cudaMemcpy(entries, host_entries.data(), max_tokens * 4, cudaMemcpyHostToDevice), "entries");
      check(cudaMemcpy(positions, host_positions.data(), max_tokens * 4, cudaMemcpyHostToDevice), "positions");
      for (const int64_t batch : batches) {
        const std::string name =
            shape_name(dtype == IndexKeyDtype::kFp8 ? "indexer_scores fp8" : "indexer_scores bf16", context, batch);
        if (!options.wants(name)) continue;
        ops::IndexerScoresParams p;
        p.num_tokens = batch;
        p.max_entries = context;
        p.softmax_scale = 1.0f / sqrtf(128.0f);
        p.keys = layout;
        p.pool = reinterpret_cast<const std::byte*>(pool);
        p.block_tables = tables;
        p.block_table_stride = blocks_per_request;
        p.request_entries = entries;
        p.token_request = token_request;
        p.token_position = positions;
        p.q = reinterpret_cast<const uint16_t*>(q);
        p.weights = weights;
        p.scores = scores;
        cudaError_t status = cudaSuccess;
        const double us = time_kernel_us([&] { status = ops::cuda::indexer_scores(p, nullptr); }, iterations);
        CaseResult r;
        if (status != cudaSuccess) {  // report and go on: one bad case must not hide the others
          r.name = shape_name("indexer_scores FAILED", context, batch);
          r.microseconds = NAN;
          r.note = cudaGetErrorString(status);
          results.push_back(r);
          cudaGetLastError();
          continue;
        }
        r.name = name;
        r.microseconds = us;
        r.flops = 2.0 * batch * context * 64 * 128;
        r.bytes = double(batch) * context * (layout.entry_bytes() + 4) + batch * (64 * 128 * 2 + 64 * 4);
        r.note = dtype == IndexKeyDtype::kFp8 ? "132 B keys + 4 B score per entry" : "256 B keys + 4 B score";
        results.push_back(r);
      }
    }
    for (void* ptr : std::initializer_list<void*>{pool, tables, q, weights, token_request, entries, positions, scores})
      cudaFree(ptr);
  }
  return results;
}

std::vector<CaseResult> top_k_cases(const Ceilings&, const Options& options) {
  std::vector<CaseResult> results;
  const std::vector<int64_t> contexts = {2048, 32768, 262144};
  const std::vector<int64_t> batches =
      options.quick ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{1, 4, 32, 64, 128};
  const int64_t max_rows = batches.back(), max_columns = contexts.back();
  const int iterations = options.quick ? 5 : 30;
  auto* scores = device_alloc<float>(max_rows * max_columns);
  fill_normal<<<4096, 256>>>(scores, max_rows * max_columns, 9);
  auto* indices = device_alloc<int32_t>(max_rows * 1024);
  auto* lengths = device_alloc<int32_t>(max_rows);
  // k 512 uses more, smaller chunks than k 1024 (more per-chunk counts): size for both.
  const size_t workspace_bytes = std::max(ops::cuda::top_k_workspace_bytes(max_rows, max_columns, 512),
                                          ops::cuda::top_k_workspace_bytes(max_rows, max_columns, 1024));
  void* workspace = device_alloc<unsigned char>(workspace_bytes);
  check(cudaGetLastError(), "scores fill");
  for (const int64_t k : {512, 1024})
    for (const int64_t columns : contexts)
      for (const int64_t batch : batches) {
        const std::string name = shape_name(k == 512 ? "top_k 512" : "top_k 1024", columns, batch);
        if (!options.wants(name)) continue;
        // rows are `columns` apart: each row's scores are distinct data
        ops::TopKParams p{batch, columns, columns, k, scores, nullptr, indices, lengths};
        cudaError_t status = cudaSuccess;
        const double us =
            time_kernel_us([&] { status = ops::cuda::top_k(p, workspace, workspace_bytes, nullptr); }, iterations);
        CaseResult r;
        if (status != cudaSuccess) {
          r.name = shape_name("top_k FAILED", columns, batch);
          r.microseconds = NAN;
          r.note = cudaGetErrorString(status);
          results.push_back(r);
          cudaGetLastError();
          continue;
        }
        r.name = name;
        r.microseconds = us;
        r.bytes = double(batch) * columns * 4 + batch * k * 4;
        r.note = "fp32 scores read once";
        results.push_back(r);
      }
  // CUDA-graph replay of the largest batch-1 cases (issue 6's 20 µs goal at 1M context): the launch gaps of a
  // captured decode step.
  for (const int64_t k : {512, 1024}) {
    const std::string name = k == 512 ? "top_k 512 256K b1 (graph)" : "top_k 1024 256K b1 (graph)";
    if (!options.wants(name)) continue;
    cudaStream_t stream;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    ops::TopKParams p{1, 262144, 262144, k, scores, nullptr, indices, lengths};
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    check(ops::cuda::top_k(p, workspace, workspace_bytes, stream), "top_k captured");
    check(cudaStreamEndCapture(stream, &graph), "capture end");
    check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    const double us = time_kernel_us([&] { cudaGraphLaunch(exec, nullptr); }, iterations);
    CaseResult r;
    r.name = name;
    r.microseconds = us;
    r.bytes = 262144.0 * 4 + static_cast<double>(k) * 4;
    r.note = "graph replay, same case";
    results.push_back(r);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
  for (void* ptr : std::initializer_list<void*>{scores, indices, lengths, workspace}) cudaFree(ptr);
  return results;
}

const bool registered_scores = register_suite("indexer_scores", score_cases);
const bool registered_top_k = register_suite("top_k", top_k_cases);

}  // namespace
}  // namespace dsv4::kbench
