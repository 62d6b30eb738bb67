// kbench suite "compressor": the fused compressor step (ops/cuda/compressor.h) on V4-Flash layer shapes.
//   csa-main   ratio 4, overlap, d 512 (width 1024)     csa-index  ratio 4, overlap, d 128 (width 256)
//   hca        ratio 128, d 512
// decode (one token per request) at batch 1 / 32 / 128 around position 8K (batch 1: a token that closes a window;
// larger batches: consecutive positions, so a quarter of the CSA requests close one), and an 8192-token prefill
// chunk at position 16384. Bytes per call (the GB/s column): the kv and gate rows read, the state bytes read
// (the head windows' old tokens and the overlap shift) and written, and the entries written. The L2 is flushed
// before every timed call (kbench.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../tests/ops/cuda/cuda_ok.h"
#include "kbench.h"
#include "ops/cuda/compressor.h"
#include "ops/cuda/device.h"

namespace dsv4::kbench {
namespace {

using ops::cuda::CompressorEntryFormat;

// Uniform floats in [lo, hi) from an integer hash of the index.
__global__ void fill_uniform(float* out, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    out[i] = lo + (hi - lo) * static_cast<float>(h) * 0x1p-32f;
  }
}

float* device_uniform(size_t n, uint32_t seed, float lo, float hi) {
  float* p = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(float)));
  fill_uniform<<<256, 256>>>(p, n, seed, lo, hi);
  DSV4_CUDA_OK(cudaGetLastError());
  return p;
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&p, std::max<size_t>(1, host.size()) * sizeof(T)));
  DSV4_CUDA_OK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

struct CompressorCase {
  const char* layer;
  int ratio, head_dim;
  bool overlap;
  CompressorEntryFormat format;
  int batch, length, start;
};

int64_t entry_bytes(CompressorEntryFormat format, int64_t d) {
  switch (format) {
    case CompressorEntryFormat::kF32: return 4 * d;
    case CompressorEntryFormat::kBf16: return 2 * d;
    case CompressorEntryFormat::kFp8Main: return 584;
    case CompressorEntryFormat::kFp8Index: return d + 4;
  }
  return 0;
}

const char* format_name(CompressorEntryFormat format) {
  switch (format) {
    case CompressorEntryFormat::kF32: return "f32";
    case CompressorEntryFormat::kBf16: return "bf16";
    case CompressorEntryFormat::kFp8Main: return "fp8";
    case CompressorEntryFormat::kFp8Index: return "fp8";
  }
  return "?";
}

CaseResult run_case(const CompressorCase& c, int iterations) {
  const int R = c.batch, T = c.batch * c.length, m = c.ratio, d = c.head_dim;
  const int coff = c.overlap ? 2 : 1, width = coff * d, slots = coff * m;
  std::vector<int32_t> starts(R), offsets(R + 1, 0);
  for (int r = 0; r < R; ++r) {
    starts[r] = c.length == 1 && R == 1 ? c.start : c.start + (c.length == 1 ? r : 0);
    offsets[r + 1] = offsets[r] + c.length;
  }
  // History: only the blocks the step writes are allocated, one page.
  const int epb = std::max(1, 256 / m);
  const int64_t eb = entry_bytes(c.format, d);
  const int64_t region = c.format == CompressorEntryFormat::kFp8Main ? (epb * 584 + 575) / 576 * 576 : epb * eb;
  int stride = 1, history_blocks = 0;
  for (int r = 0; r < R; ++r) stride = std::max(stride, (starts[r] + c.length) / m / epb + 1);
  std::vector<int32_t> history_table(static_cast<size_t>(R) * stride, -1);
  double bytes = 0;
  for (int r = 0; r < R; ++r) {
    const int s = starts[r], e = s + c.length, w0 = s / m, we = e / m, i0 = s % m;
    for (int w = w0; w < we; ++w) {
      int32_t& id = history_table[static_cast<size_t>(r) * stride + w / epb];
      if (id < 0) id = history_blocks++;
    }
    bytes += 8.0 * c.length * width;                                              // kv + gate rows
    bytes += 8.0 * std::min(c.length, m) * width;                                 // current-window slots written
    if (we > w0) bytes += 8.0 * (c.overlap ? m : 0) * width + (we - w0) * double(eb);  // shift, entries
    if (we > w0) bytes += 8.0 * ((c.overlap ? m : 0) + i0) * width;               // old state read
  }
  std::byte* history = nullptr;
  const int64_t history_bytes = std::max(1, history_blocks) * region;
  DSV4_CUDA_OK(cudaMalloc(&history, history_bytes));
  DSV4_CUDA_OK(cudaMemset(history, 0, history_bytes));
  const int64_t state_entry = 2 * int64_t{slots} * width * 4;
  float* state = device_uniform(static_cast<size_t>(R) * state_entry / 4, 7, -2.0f, 2.0f);
  std::vector<int32_t> state_table(R);
  for (int r = 0; r < R; ++r) state_table[r] = r;

  float* kv = device_uniform(static_cast<size_t>(T) * width, 1, -2.0f, 2.0f);
  float* gate = device_uniform(static_cast<size_t>(T) * width, 2, -4.0f, 4.0f);
  float* ape = device_uniform(static_cast<size_t>(m) * width, 3, -1.0f, 1.0f);
  float* weight = device_uniform(d, 4, 0.5f, 1.5f);
  float* inv_freq = device_uniform(32, 5, 0.0f, 1.0f);
  int32_t* d_starts = device_copy(starts);
  int32_t* d_offsets = device_copy(offsets);
  int32_t* d_history_table = device_copy(history_table);
  int32_t* d_state_table = device_copy(state_table);

  ops::cuda::CompressorStepParams p;
  p.ratio = m;
  p.head_dim = d;
  p.overlap = c.overlap;
  p.rope_dim = 64;
  p.attention_scaling = 1.2772589f;
  p.eps = 1e-6f;
  p.format = c.format;
  p.num_requests = R;
  p.num_tokens = T;
  p.kv = kv;
  p.gate = gate;
  p.ape = ape;
  p.norm_weight = weight;
  p.inv_freq = inv_freq;
  p.start_positions = d_starts;
  p.token_offsets = d_offsets;
  p.state.arena = reinterpret_cast<std::byte*>(state);
  p.state.entry_bytes = state_entry;
  p.state.entries_per_block = 1;
  p.state.block_bytes = state_entry;
  p.state.page_bytes = state_entry * R;
  p.state.max_blocks_per_page = R;
  p.state.block_table = d_state_table;
  p.state.block_table_stride = 1;
  p.history.arena = history;
  p.history.entry_bytes = eb;
  p.history.entries_per_block = epb;
  p.history.block_bytes = region;
  p.history.page_bytes = history_bytes;
  p.history.max_blocks_per_page = std::max(1, history_blocks);
  p.history.block_table = d_history_table;
  p.history.block_table_stride = stride;

  auto launch = [&] { DSV4_CUDA_OK(ops::cuda::compressor_step(p, nullptr)); };
  // Warm the clock up (the host set-up idles the GPU), as the attention suite does.
  cudaEvent_t start, stop;
  DSV4_CUDA_OK(cudaEventCreate(&start));
  DSV4_CUDA_OK(cudaEventCreate(&stop));
  for (float busy_ms = 0; busy_ms < 50.0f;) {
    DSV4_CUDA_OK(cudaEventRecord(start));
    for (int i = 0; i < 50; ++i) launch();
    DSV4_CUDA_OK(cudaEventRecord(stop));
    DSV4_CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    DSV4_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    busy_ms += ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const double us = time_kernel_us(launch, iterations);

  CaseResult result;
  char name[160];
  std::snprintf(name, sizeof name, "%s %s %s b=%d len=%d pos=%d grid=%d", c.layer, format_name(c.format),
                c.length == 1 ? "decode" : "prefill", c.batch, c.length, c.start,
                ops::cuda::compressor_step_blocks(p));
  result.name = name;
  result.microseconds = us;
  result.flops = 0;
  result.bytes = bytes;
  for (void* ptr : {static_cast<void*>(history), static_cast<void*>(state), static_cast<void*>(kv),
                    static_cast<void*>(gate), static_cast<void*>(ape), static_cast<void*>(weight),
                    static_cast<void*>(inv_freq), static_cast<void*>(d_starts), static_cast<void*>(d_offsets),
                    static_cast<void*>(d_history_table), static_cast<void*>(d_state_table)})
    cudaFree(ptr);
  return result;
}

std::vector<CaseResult> compressor_suite(const Ceilings&, const Options& options) {
  std::vector<CaseResult> results;
  if (ops::cuda::list_devices().empty()) return results;
  const int iterations = options.quick ? 5 : 30;
  std::vector<CompressorCase> cases;
  for (const int batch : {1, 32, 128}) {
    cases.push_back({"csa-main", 4, 512, true, CompressorEntryFormat::kBf16, batch, 1, 8195});
    cases.push_back({"csa-index", 4, 128, true, CompressorEntryFormat::kBf16, batch, 1, 8195});
    cases.push_back({"hca", 128, 512, false, CompressorEntryFormat::kBf16, batch, 1, 8191});
  }
  cases.push_back({"csa-main", 4, 512, true, CompressorEntryFormat::kBf16, 1, 8192, 16384});
  cases.push_back({"csa-main", 4, 512, true, CompressorEntryFormat::kFp8Main, 1, 8192, 16384});
  cases.push_back({"csa-index", 4, 128, true, CompressorEntryFormat::kBf16, 1, 8192, 16384});
  cases.push_back({"csa-index", 4, 128, true, CompressorEntryFormat::kFp8Index, 1, 8192, 16384});
  cases.push_back({"hca", 128, 512, false, CompressorEntryFormat::kBf16, 1, 8192, 16384});
  cases.push_back({"csa-main", 4, 512, true, CompressorEntryFormat::kBf16, 1, 8192, 16385});  // unaligned chunk
  for (const CompressorCase& c : cases) results.push_back(run_case(c, iterations));
  return results;
}

const bool registered = register_suite("compressor", compressor_suite);

}  // namespace
}  // namespace dsv4::kbench
