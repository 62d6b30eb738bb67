// A batch of requests fed through several consecutive compressor steps, on the device (ops/cuda/compressor.h) and
// on the host (ops::cpu::compressor_append + rms_norm + apply_rope, DeepseekV4Model::compress in kHf, or
// ops::cpu::finish_entry_deepseek for the kDeepSeek formats), over paged
// history and state arenas: shuffled block ids across pages, unallocated (-1) blocks where nothing is written,
// random bytes everywhere else (so a stray write shows). The host side writes its fp32 entries through a
// format writer given by the test (the project's own quantizers), so this header depends on no entry-format
// header (cache/kv_entry_format.h and cache/index_key_format.h cannot share a translation unit).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cache/paged_group_view.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/compressor.h"
#include "ops/cuda/device.h"

namespace dsv4::testing {

// The fixture of every CudaCompressor.* test (one type for all their translation units, as gtest requires).
class CudaCompressor : public ::testing::Test {
 protected:
  void SetUp() override {
    if (ops::cuda::list_devices().empty()) GTEST_SKIP() << "no CUDA device";
  }
};

using ops::cuda::CompressorEntryFormat;

struct CompressorCase {
  int ratio = 4, head_dim = 512, rope_dim = 64;
  bool overlap = true;
  CompressorEntryFormat format = CompressorEntryFormat::kF32;
  std::vector<int32_t> starts;              // per request: position before the first step
  std::vector<std::vector<int32_t>> steps;  // per step, per request: chunk length (0 allowed)
  uint32_t seed = 1;
  int history_layers = 3, history_layer_index = 1;
  int state_layers = 2, state_layer_index = 1;
  int max_blocks = 0;
};

struct CompressorEntry {
  int64_t row = 0, w = 0;
  std::vector<float> values;  // head_dim, normed and rotated
};

inline int64_t compressor_entry_bytes(CompressorEntryFormat format, int64_t d) {
  switch (format) {
    case CompressorEntryFormat::kF32: return 4 * d;
    case CompressorEntryFormat::kBf16: return 2 * d;
    case CompressorEntryFormat::kFp8Main: return 584;
    case CompressorEntryFormat::kFp8Index: return d + 4;
    case CompressorEntryFormat::kBf16DeepSeekMain:
    case CompressorEntryFormat::kBf16DeepSeekIndex: return 2 * d;
  }
  return 0;
}

// One layer's region of `epb` entries in a block (kFp8Main: padded to 576 B, cache/kv_entry_format.h).
inline int64_t compressor_region_bytes(CompressorEntryFormat format, int64_t d, int64_t epb) {
  if (format == CompressorEntryFormat::kFp8Main) return (epb * 584 + 575) / 576 * 576;
  return epb * compressor_entry_bytes(format, d);
}

// A paged group on the host: bytes, block table, and the view (arena pointer filled in per use).
struct HostPagedGroup {
  std::vector<std::byte> bytes;
  std::vector<int32_t> table;
  PagedGroupView view;
  PagedGroupView on(std::byte* arena, const int32_t* table_ptr) const {
    PagedGroupView v = view;
    v.arena = arena;
    v.block_table = table_ptr;
    return v;
  }
};

struct CompressorSnapshot {
  std::vector<std::byte> history, state;
};

class CompressorProblem {
 public:
  explicit CompressorProblem(const CompressorCase& c) : c_(c) {
    std::mt19937 rng(c.seed);
    const int64_t R = static_cast<int64_t>(c.starts.size());
    const int64_t m = c.ratio, d = c.head_dim, width = (c.overlap ? 2 : 1) * d, slots = (c.overlap ? 2 : 1) * m;
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    ape_.resize(static_cast<size_t>(m * width));
    for (float& v : ape_) v = unit(rng);
    weight_.resize(static_cast<size_t>(d));
    for (float& v : weight_) v = 1.0f + 0.5f * unit(rng);
    rope_.attention_scaling = 1.2772589f;  // YaRN 0.1·ln(16) + 1
    for (int i = 0; i < c.rope_dim / 2; ++i) {
      const float base = std::pow(160000.0f, -2.0f * static_cast<float>(i) / static_cast<float>(c.rope_dim));
      rope_.inv_freq.push_back(i < c.rope_dim / 4 ? base / 16.0f : base);
    }
    rows_.resize(static_cast<size_t>(R));
    std::iota(rows_.begin(), rows_.end(), 0);
    std::shuffle(rows_.begin(), rows_.end(), rng);

    // History: 256-token logical blocks of 256 / m entries; blocks wholly before the first written entry are -1.
    const int64_t epb = std::max<int64_t>(1, 256 / m);
    std::vector<int64_t> first_block(static_cast<size_t>(R)), blocks(static_cast<size_t>(R));
    int64_t stride = 1, needed = 0;
    for (int64_t r = 0; r < R; ++r) {
      int64_t end = c.starts[r];
      for (const auto& step : c.steps) end += step[r];
      blocks[r] = (end / m + epb - 1) / epb;
      first_block[r] = std::min(blocks[r], c.starts[r] / m / epb);
      stride = std::max(stride, blocks[r] + 2);
      needed += blocks[r] - first_block[r];
    }
    PagedGroupView& h = history_.view;
    h.entry_bytes = compressor_entry_bytes(c.format, d);
    h.entries_per_block = epb;
    h.layer_index = c.history_layer_index;
    h.block_bytes = c.history_layers * compressor_region_bytes(c.format, d, epb) + 16;
    h.max_blocks_per_page = 3;
    h.page_bytes = 3 * h.block_bytes + 32;
    h.block_table_stride = stride;
    const int64_t pages = (needed + 2) / 3 + 1;
    std::vector<int32_t> ids(static_cast<size_t>(pages * 3));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    history_.table.assign(static_cast<size_t>(R * stride), -1);
    size_t next = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = first_block[r]; b < blocks[r]; ++b) history_.table[rows_[r] * stride + b] = ids[next++];
    history_.bytes.resize(static_cast<size_t>(pages * h.page_bytes));
    for (std::byte& b : history_.bytes) b = static_cast<std::byte>(rng() & 0xffu);

    // State: one block per row (a second table column left -1), random finite floats everywhere.
    PagedGroupView& s = state_.view;
    s.entry_bytes = 2 * slots * width * 4;
    s.entries_per_block = 1;
    s.layer_index = c.state_layer_index;
    s.block_bytes = c.state_layers * s.entry_bytes;
    s.max_blocks_per_page = 2;
    s.page_bytes = 2 * s.block_bytes + 64;
    s.block_table_stride = 2;
    const int64_t state_pages = (R + 1) / 2 + 1;
    std::vector<int32_t> state_ids(static_cast<size_t>(state_pages * 2));
    std::iota(state_ids.begin(), state_ids.end(), 0);
    std::shuffle(state_ids.begin(), state_ids.end(), rng);
    state_.table.assign(static_cast<size_t>(R * 2), -1);
    for (int64_t r = 0; r < R; ++r) state_.table[rows_[r] * 2] = state_ids[r];
    state_.bytes.resize(static_cast<size_t>(state_pages * s.page_bytes));
    for (size_t i = 0; i + 4 <= state_.bytes.size(); i += 4) {
      const float v = 2.0f * unit(rng);
      std::memcpy(&state_.bytes[i], &v, 4);
    }

    // Inputs of every step.
    std::vector<int32_t> position(c.starts.begin(), c.starts.end());
    for (const auto& lengths : c.steps) {
      Step step;
      step.starts = position;
      step.offsets.push_back(0);
      for (int64_t r = 0; r < R; ++r) {
        step.offsets.push_back(step.offsets.back() + lengths[r]);
        position[r] += lengths[r];
      }
      const int64_t T = step.offsets.back();
      step.kv.resize(static_cast<size_t>(T * width));
      step.gate.resize(static_cast<size_t>(T * width));
      for (float& v : step.kv) v = 2.0f * unit(rng);
      for (float& v : step.gate) v = 4.0f * unit(rng);
      steps_.push_back(std::move(step));
    }
  }

  const CompressorCase& spec() const { return c_; }
  int64_t width() const { return (c_.overlap ? 2 : 1) * c_.head_dim; }

  size_t num_steps() const { return steps_.size(); }

  // The device side: arenas uploaded once, then one launch per step(); snapshot() downloads both arenas.
  class GpuRun {
   public:
    GpuRun(const CompressorProblem& problem, int max_blocks) : pr_(problem), max_blocks_(max_blocks) {
      history_ = upload(pr_.history_.bytes);
      state_ = upload(pr_.state_.bytes);
      history_table_ = upload(pr_.history_.table);
      state_table_ = upload(pr_.state_.table);
      rows_ = upload(pr_.rows_);
      ape_ = upload(pr_.ape_);
      weight_ = upload(pr_.weight_);
      inv_freq_ = upload(pr_.rope_.inv_freq);
    }
    GpuRun(const GpuRun&) = delete;
    GpuRun& operator=(const GpuRun&) = delete;
    ~GpuRun() {
      for (void* ptr : {static_cast<void*>(history_), static_cast<void*>(state_), static_cast<void*>(history_table_),
                        static_cast<void*>(state_table_), static_cast<void*>(rows_), static_cast<void*>(ape_),
                        static_cast<void*>(weight_), static_cast<void*>(inv_freq_)})
        cudaFree(ptr);
    }
    // Launches step `s`; returns the launch status, then the synchronisation status.
    cudaError_t step(size_t s) {
      const CompressorCase& c = pr_.c_;
      const Step& step = pr_.steps_[s];
      float *d_kv = upload(step.kv), *d_gate = upload(step.gate);
      int32_t *d_starts = upload(step.starts), *d_offsets = upload(step.offsets);
      ops::cuda::CompressorStepParams p;
      p.ratio = c.ratio;
      p.head_dim = c.head_dim;
      p.overlap = c.overlap;
      p.rope_dim = c.rope_dim;
      p.attention_scaling = pr_.rope_.attention_scaling;
      p.eps = kEps;
      p.format = c.format;
      p.num_requests = static_cast<int32_t>(c.starts.size());
      p.num_tokens = step.offsets.back();
      p.max_blocks = max_blocks_ >= 0 ? max_blocks_ : c.max_blocks;
      p.kv = d_kv;
      p.gate = d_gate;
      p.ape = ape_;
      p.norm_weight = weight_;
      p.inv_freq = inv_freq_;
      p.start_positions = d_starts;
      p.token_offsets = d_offsets;
      p.table_rows = rows_;
      p.state = pr_.state_.on(state_, state_table_);
      p.history = pr_.history_.on(history_, history_table_);
      cudaError_t status = ops::cuda::compressor_step(p, nullptr);
      const cudaError_t sync = cudaDeviceSynchronize();
      if (status == cudaSuccess) status = sync;
      for (void* ptr : {static_cast<void*>(d_kv), static_cast<void*>(d_gate), static_cast<void*>(d_starts),
                        static_cast<void*>(d_offsets)})
        cudaFree(ptr);
      return status;
    }
    CompressorSnapshot snapshot() const {
      return {download(history_, pr_.history_.bytes.size()), download(state_, pr_.state_.bytes.size())};
    }

   private:
    const CompressorProblem& pr_;
    int max_blocks_;
    std::byte *history_ = nullptr, *state_ = nullptr;
    int32_t *history_table_ = nullptr, *state_table_ = nullptr, *rows_ = nullptr;
    float *ape_ = nullptr, *weight_ = nullptr, *inv_freq_ = nullptr;
  };

  // The host reference: compressor_append token by token, then rms_norm and apply_rope on a closed window, the
  // entry written by `write` (given the host view of the history arena).
  using Writer = std::function<void(const PagedGroupView& history, const CompressorEntry& entry)>;
  class CpuRun {
   public:
    CpuRun(const CompressorProblem& problem, Writer write)
        : pr_(problem), write_(std::move(write)), snap_{problem.history_.bytes, problem.state_.bytes} {}
    // Runs step `s`; returns the entries it produced.
    std::vector<CompressorEntry> step(size_t s) {
      const CompressorCase& c = pr_.c_;
      const Step& step = pr_.steps_[s];
      const PagedGroupView hv = pr_.history_.on(snap_.history.data(), pr_.history_.table.data());
      const PagedGroupView sv = pr_.state_.on(snap_.state.data(), pr_.state_.table.data());
      const ops::cpu::CompressorParams cp{c.ratio, c.head_dim, c.overlap};
      const int64_t width = cp.width(), slots = cp.state_slots();
      std::vector<CompressorEntry> produced;
      for (size_t r = 0; r < c.starts.size(); ++r) {
        const int64_t row = pr_.rows_[r];
        float* kv_state = reinterpret_cast<float*>(paged_entry(sv, row, 0));
        float* gate_state = kv_state + slots * width;
        for (int64_t t = step.offsets[r]; t < step.offsets[r + 1]; ++t) {
          const int64_t position = step.starts[r] + (t - step.offsets[r]);
          CompressorEntry entry;
          entry.values.resize(static_cast<size_t>(c.head_dim));
          if (!ops::cpu::compressor_append(cp, kv_state, gate_state, &step.kv[t * width], &step.gate[t * width],
                                           pr_.ape_.data(), position, entry.values.data()))
            continue;
          entry.row = row;
          entry.w = position / c.ratio;
          const int64_t entry_position = entry.w * c.ratio;
          if (c.format == CompressorEntryFormat::kBf16DeepSeekMain ||
              c.format == CompressorEntryFormat::kBf16DeepSeekIndex) {
            ops::cpu::finish_entry_deepseek(entry.values.data(), c.head_dim, pr_.weight_.data(), kEps,
                                            entry_position, pr_.rope_,
                                            c.format == CompressorEntryFormat::kBf16DeepSeekIndex);
          } else {
            ops::cpu::rms_norm(entry.values.data(), 1, c.head_dim, c.head_dim, pr_.weight_.data(), kEps,
                               entry.values.data());
            ops::cpu::apply_rope(entry.values.data(), 1, c.head_dim, 1, c.head_dim, &entry_position, pr_.rope_);
          }
          write_(hv, entry);
          produced.push_back(std::move(entry));
        }
      }
      return produced;
    }
    const CompressorSnapshot& snapshot() const { return snap_; }

   private:
    const CompressorProblem& pr_;
    Writer write_;
    CompressorSnapshot snap_;
  };

  static constexpr float kEps = 1e-6f;

 private:
  struct Step {
    std::vector<int32_t> starts, offsets;
    std::vector<float> kv, gate;
  };

  template <typename T>
  static T* upload(const std::vector<T>& host) {
    T* device = nullptr;
    if (cudaMalloc(&device, std::max<size_t>(1, host.size()) * sizeof(T)) != cudaSuccess) return nullptr;
    if (!host.empty()) cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    return device;
  }
  static std::vector<std::byte> download(const std::byte* device, size_t bytes) {
    std::vector<std::byte> host(bytes);
    cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost);
    return host;
  }

  CompressorCase c_;
  std::vector<float> ape_, weight_;
  ops::cpu::RopeTable rope_;
  std::vector<int32_t> rows_;
  HostPagedGroup history_, state_;
  std::vector<Step> steps_;
};

// The V4-Flash batch of the brief: starts 0, 3, 127, 128, 1000, chunk lengths 1, 2, 5, 300, 1030 in the first step,
// then rotated, decode steps, a step with an empty chunk.
inline std::vector<int32_t> flash_starts() { return {0, 3, 127, 128, 1000}; }
inline std::vector<std::vector<int32_t>> flash_steps() {
  return {{1, 2, 5, 300, 1030}, {1030, 300, 5, 2, 1}, {1, 1, 1, 1, 1}, {4, 7, 0, 129, 3}, {1, 1, 1, 1, 1}, {2, 1, 3, 1, 1}};
}

}  // namespace dsv4::testing
