// The softmax-gated token compressor of CSA/HCA layers and of the lightning indexer (docs/MODEL.md
// "Compressors"; transformers DeepseekV4{HCA,CSA}Compressor / DeepseekV4Indexer), in streaming form: tokens
// enter one at a time into a bounded state and an entry is emitted whenever a window of `ratio` tokens closes,
// so any split of a sequence into chunks produces the same entries.
//
// State layout (per sequence and compressor, fp32, the layout of DeepSeek's reference `kv_state/score_state`):
//   kv_state, gate_state: [state_slots, width] with width = coff·head_dim, state_slots = coff·ratio,
//   coff = 2 when overlapping (CSA), else 1. Gates are stored with the position bias (`ape`) already added.
//   Overlap: slots [0, ratio) hold the previous complete window, slots [ratio, 2·ratio) the current one.
// Entry w (tokens [w·ratio, (w+1)·ratio)) pools per channel c with one softmax over
//   non-overlap: the window's tokens at channel c;
//   overlap: the previous window's tokens at channel c (the "a" half; absent for w = 0) and the window's
//            tokens at channel head_dim + c (the "b" half).
#pragma once
#include <cstdint>

namespace dsv4::ops::cpu {

struct CompressorParams {
  int64_t ratio = 4;
  int64_t head_dim = 0;  // entry width d
  bool overlap = false;
  int64_t coff() const { return overlap ? 2 : 1; }
  int64_t width() const { return coff() * head_dim; }
  int64_t state_slots() const { return coff() * ratio; }
};

// Adds the token at `position` (its projections kv [width] and gate [width]; ape [ratio, width]) to the state.
// If it closes a window, writes the pooled (un-normalised, un-rotated) entry [head_dim] to `entry` and returns
// true; the entry's index is position / ratio.
bool compressor_append(const CompressorParams& p, float* kv_state, float* gate_state, const float* kv,
                       const float* gate, const float* ape, int64_t position, float* entry);

}  // namespace dsv4::ops::cpu
