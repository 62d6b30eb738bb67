// Device copies of a sparse-attention problem (tests/ops/sparse_attention_problem.h) for the GPU tests and kbench.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "../sparse_attention_problem.h"
#include "cuda_ok.h"

namespace dsv4::testing {

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* device = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&device, std::max<size_t>(1, host.size()) * sizeof(T)));
  if (!host.empty()) DSV4_CUDA_OK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

struct DeviceProblem {
  uint8_t* arena = nullptr;
  int32_t *window_table = nullptr, *compressed_table = nullptr, *indices = nullptr, *lengths = nullptr,
          *positions = nullptr, *chunk_table = nullptr, *chunk_starts = nullptr, *rows = nullptr;
  float *sinks = nullptr, *inv_freq = nullptr;
  uint16_t *q = nullptr, *out = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  size_t out_elements = 0;

  explicit DeviceProblem(const AttentionProblem& pr) {
    arena = to_device(pr.arena);
    window_table = to_device(pr.window_table);
    compressed_table = to_device(pr.compressed_table);
    indices = to_device(pr.indices);
    lengths = to_device(pr.lengths);
    positions = to_device(pr.positions);
    chunk_table = to_device(pr.chunk_table);
    chunk_starts = to_device(pr.chunk_starts);
    rows = to_device(pr.rows);
    sinks = to_device(pr.sinks);
    inv_freq = to_device(pr.inv_freq);
    q = to_device(pr.q);
    out_elements = pr.q.size();
    DSV4_CUDA_OK(cudaMalloc(&out, out_elements * sizeof(uint16_t)));
  }
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;
  ~DeviceProblem() {
    for (void* p : {static_cast<void*>(arena), static_cast<void*>(window_table), static_cast<void*>(compressed_table),
                    static_cast<void*>(indices), static_cast<void*>(lengths), static_cast<void*>(positions),
                    static_cast<void*>(sinks), static_cast<void*>(inv_freq), static_cast<void*>(q),
                    static_cast<void*>(out), static_cast<void*>(chunk_table), static_cast<void*>(chunk_starts),
                    static_cast<void*>(rows), workspace})
      if (p) cudaFree(p);
  }
  ops::SparseAttentionParams params(const AttentionProblem& pr) const {
    return pr.params(arena, window_table, compressed_table, indices, lengths, positions, sinks, inv_freq, chunk_table,
                     chunk_starts, rows);
  }
  void reserve_workspace(size_t bytes) {
    if (bytes <= workspace_bytes) return;
    if (workspace) DSV4_CUDA_OK(cudaFree(workspace));
    DSV4_CUDA_OK(cudaMalloc(&workspace, bytes));
    workspace_bytes = bytes;
  }
};

}  // namespace dsv4::testing
