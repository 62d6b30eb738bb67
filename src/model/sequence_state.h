// Per-request model state between forward calls (docs/MODEL.md "Compressors", "State between calls"):
//   - the raw K=V window of every layer (the last `sliding_window` tokens),
//   - the compressor state of every CSA/HCA layer and of every CSA layer's indexer (the tokens of the open
//     window, and for CSA the previous complete window whose "a" halves the next entry pools),
//   - the compressed entries (main K=V entries of CSA/HCA layers, index keys of CSA layers).
// The model reads and writes only through this interface, so the storage behind it (contiguous per request
// here, the paged hybrid cache later) can change without touching the math.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/model_config.h"

namespace dsv4 {

enum class EntryKind { kMain, kIndex };  // a layer's attention compressor, or its lightning indexer's

class SequenceState {
 public:
  virtual ~SequenceState() = default;

  // Tokens whose state is stored; the next forward appends at this position.
  virtual int64_t num_tokens() const = 0;
  virtual void set_num_tokens(int64_t tokens) = 0;

  // Raw K=V vector [head_dim] of absolute `position`, which must lie within the last sliding_window tokens.
  virtual float* window_kv(int64_t layer, int64_t position) = 0;

  // Compressor state [state_slots, width] (ops/cpu/compressor.h) of a layer's main or index compressor.
  virtual float* compressor_kv_state(int64_t layer, EntryKind kind) = 0;
  virtual float* compressor_gate_state(int64_t layer, EntryKind kind) = 0;

  // Compressed entries of a layer: entry(i) is [entry_dim] (head_dim for main, index_head_dim for index).
  virtual int64_t num_entries(int64_t layer, EntryKind kind) const = 0;
  virtual const float* entry(int64_t layer, EntryKind kind, int64_t index) const = 0;
  // Appends an entry and returns where to write it. Pointers from entry() may be invalidated.
  virtual float* append_entry(int64_t layer, EntryKind kind) = 0;
};

// Everything in growing host vectors, one set per request: the foundation's reference storage.
class ContiguousSequenceState final : public SequenceState {
 public:
  explicit ContiguousSequenceState(const ModelConfig& config);

  int64_t num_tokens() const override { return num_tokens_; }
  void set_num_tokens(int64_t tokens) override { num_tokens_ = tokens; }
  float* window_kv(int64_t layer, int64_t position) override;
  float* compressor_kv_state(int64_t layer, EntryKind kind) override { return store(layer, kind).kv_state.data(); }
  float* compressor_gate_state(int64_t layer, EntryKind kind) override { return store(layer, kind).gate_state.data(); }
  int64_t num_entries(int64_t layer, EntryKind kind) const override;
  const float* entry(int64_t layer, EntryKind kind, int64_t index) const override;
  float* append_entry(int64_t layer, EntryKind kind) override;

 private:
  struct CompressorStore {
    int64_t entry_dim = 0;
    std::vector<float> kv_state, gate_state, entries;
  };
  CompressorStore& store(int64_t layer, EntryKind kind);
  const CompressorStore& store(int64_t layer, EntryKind kind) const;

  int64_t num_tokens_ = 0;
  int64_t window_ = 0, head_dim_ = 0;
  std::vector<std::vector<float>> window_ring_;  // per layer [window, head_dim], slot = position % window
  std::vector<CompressorStore> main_, index_;     // per layer (empty when the layer has none)
};

}  // namespace dsv4
