#include "model/sequence_state.h"

#include <cmath>

#include "core/error.h"
#include "ops/cpu/compressor.h"

namespace dsv4 {

ContiguousSequenceState::ContiguousSequenceState(const ModelConfig& config)
    : window_(config.sliding_window), head_dim_(config.head_dim) {
  const auto layers = static_cast<size_t>(config.num_hidden_layers);
  window_ring_.assign(layers, std::vector<float>(static_cast<size_t>(window_ * head_dim_)));
  main_.resize(layers);
  index_.resize(layers);
  auto init = [](CompressorStore& store, const ops::cpu::CompressorParams& p) {
    store.entry_dim = p.head_dim;
    const auto size = static_cast<size_t>(p.state_slots() * p.width());
    store.kv_state.assign(size, 0.0f);
    store.gate_state.assign(size, -INFINITY);
  };
  for (size_t layer = 0; layer < layers; ++layer) {
    const AttentionType type = config.layer_types[layer];
    if (type == AttentionType::kSlidingWindow) continue;
    const bool csa = type == AttentionType::kCompressedSparse;
    init(main_[layer], {config.compress_rate(static_cast<int64_t>(layer)), config.head_dim, csa});
    if (csa) init(index_[layer], {config.compress_rate_csa, config.index_head_dim, true});
  }
}

float* ContiguousSequenceState::window_kv(int64_t layer, int64_t position) {
  return window_ring_[static_cast<size_t>(layer)].data() + (position % window_) * head_dim_;
}

ContiguousSequenceState::CompressorStore& ContiguousSequenceState::store(int64_t layer, EntryKind kind) {
  auto& store = (kind == EntryKind::kMain ? main_ : index_)[static_cast<size_t>(layer)];
  DSV4_CHECK(store.entry_dim > 0, "layer " + std::to_string(layer) + " has no such compressor");
  return store;
}

const ContiguousSequenceState::CompressorStore& ContiguousSequenceState::store(int64_t layer, EntryKind kind) const {
  return const_cast<ContiguousSequenceState*>(this)->store(layer, kind);
}

int64_t ContiguousSequenceState::num_entries(int64_t layer, EntryKind kind) const {
  const auto& s = store(layer, kind);
  return static_cast<int64_t>(s.entries.size()) / s.entry_dim;
}

const float* ContiguousSequenceState::entry(int64_t layer, EntryKind kind, int64_t index) const {
  const auto& s = store(layer, kind);
  return s.entries.data() + index * s.entry_dim;
}

float* ContiguousSequenceState::append_entry(int64_t layer, EntryKind kind) {
  auto& s = store(layer, kind);
  s.entries.resize(s.entries.size() + static_cast<size_t>(s.entry_dim));
  return s.entries.data() + s.entries.size() - static_cast<size_t>(s.entry_dim);
}

}  // namespace dsv4
