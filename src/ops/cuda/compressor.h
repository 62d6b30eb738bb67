// The fused compressor step on the device: for one layer and one compressor (the main K=V compressor of a CSA /
// HCA layer, or the lightning indexer's), a batch of requests each appends a chunk of consecutive tokens, and
// every window of `ratio` tokens that closes is pooled, RMS-normed, rotated at its first position and stored in
// the paged history. One launch per layer and compressor per forward step; CUDA-graph safe (no allocation, no
// host synchronisation, the grid depends only on the host-side sizes).
//
// Semantics: token by token in order, exactly ops::cpu::compressor_append (ops/cpu/compressor.h) on the request's
// state, then on a closed window w: ops::cpu::rms_norm with the norm weight, ops::cpu::apply_rope at position
// w·ratio (interleaved pairs over the trailing rope_dim channels, angle = fp32(inv_freq[i] · position)), and the
// store of entry w — DeepseekV4Model::compress in Numerics::kHf. The state is left byte for byte as the
// sequential CPU leaves it (kv copied, gate + ape added in fp32, the overlap shift); the fp32 arithmetic of the
// pooling, the norm and the rope is done in the CPU's order without contraction, so entries differ from the CPU
// only through expf (CUDA's ≤ 2 ulp against glibc's): on the H200 about a quarter of fp32 values differ in the
// last bits (within 1e-5), and a handful of bf16 values per thousands of entries are one ulp off.
//
// Inputs (device unless noted):
//   kv, gate      fp32 [num_tokens, width], width = coff·head_dim (x·wkvᵀ, x·wgateᵀ); the rows of request r are
//                 [token_offsets[r], token_offsets[r+1]), at positions start_positions[r] + 0, 1, ... in order.
//   ape           fp32 [ratio, width];  norm_weight fp32 [head_dim];  inv_freq fp32 [rope_dim / 2].
//   state         PagedGroupView of the compressor-state group (kC4MainState / kC4IndexState / kC128State):
//                 request r uses table row table_rows[r] (identity when nullptr), entry 0 of that row is the
//                 layer's state, which must be allocated: kv_state [state_slots, width] fp32 at
//                 paged_entry(state, row, 0), gate_state [state_slots, width] right after it (state.entry_bytes
//                 must be 2·state_slots·width·4, engine/paged_sequence_state.cpp's layout).
//   history       PagedGroupView of the history group (kC4Main / kC4Index / kC128Main), same table row; entry
//                 w = position / ratio. An entry whose block id is < 0 is not written.
//
// Entry formats (`format`) and how entry w of table row `row` is addressed. Let block = the id at
// history.block_table[row·stride + w / epb] (epb = history.entries_per_block, e = w % epb) and
// B = arena + (block / max_blocks_per_page)·page_bytes + (block % max_blocks_per_page)·block_bytes:
//   kF32       head_dim fp32 (the exact mode):   paged_entry(history, row, w) = B + (layer_index·epb + e)·entry_bytes,
//              entry_bytes = 4·head_dim.
//   kBf16      head_dim bf16, round to nearest even (KvEntryFormat::kBf16 without fake quantization for the main
//              entries, IndexKeyDtype::kBf16 for index keys): paged_entry as above, entry_bytes = 2·head_dim
//              (1024 main, 256 index).
//   kFp8Main   cache/kv_entry_format.h KvEntryFormat::kFp8 (head_dim 512, rope_dim 64 only): the fp32 entry is
//              rounded to bf16, then quantized as kv_quantize_entry does. The layer's region starts at
//              R = B + layer_index · kv_region_bytes(kFp8, epb) (epb·584 rounded up to a multiple of 576); data
//              (448 e4m3 + 64 bf16) at R + e·576, the 8 scale bytes (7 UE8M0 + 0) at R + epb·576 + e·8.
//              history.entry_bytes must be 584 (it is not the stride); block_bytes must hold every region.
//   kFp8Index  cache/index_key_format.h IndexKeyDtype::kFp8 (head_dim a multiple of 4): the fp32 key rounded
//              to bf16, then one scale over
//              the whole key as write_index_keys_cpu does. The layer's run starts at
//              U = B + layer_index·epb·(head_dim + 4); values (head_dim e4m3) at U + e·head_dim, the fp32 scale
//              at U + epb·head_dim + 4·e. history.entry_bytes must be head_dim + 4.
//   kBf16DeepSeekMain, kBf16DeepSeekIndex
//              Numerics::kDeepSeek (docs/numerics.md): stored as kBf16, the entry finished as
//              ops::cpu::finish_entry_deepseek does — the pooled values rounded to bf16 before the norm, the norm's
//              output and the rotated entry rounded too; then a main entry's non-rope channels through e4m3 per 64
//              ((head_dim − rope_dim) a multiple of 64), or an index key through the Hadamard rotation (head_dim 64,
//              128 or 256; butterflies exact in double, as the CPU's) and FP4 per 32. Bit for bit the CPU twin but
//              for expf's last bit in the pooling (above).
//
// Work split (docs in compressor.cu): per request one "head" task pools the windows that read the old state (the
// window straddling the chunk start and, for the overlapping CSA compressor, the next one, whose "a" half
// starts before the chunk), then rewrites the state slots the old state values came from; every other closed
// window is pooled straight from the kv/gate rows by independent tasks (several windows per CTA), and the
// remaining state slots are written by further tasks. Tasks are laid out flat over the batch, so a decode batch
// of 128 is ~128 small CTAs and an 8192-token prefill spreads over hundreds.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "cache/paged_group_view.h"

namespace dsv4::ops::cuda {

enum class CompressorEntryFormat : int32_t {
  kF32 = 0,
  kBf16 = 1,
  kFp8Main = 2,
  kFp8Index = 3,
  kBf16DeepSeekMain = 4,
  kBf16DeepSeekIndex = 5
};

struct CompressorStepParams {
  // Compressor shape (ops::cpu::CompressorParams).
  int32_t ratio = 4;
  int32_t head_dim = 512;  // even, at most 512
  bool overlap = true;     // CSA: coff = 2
  int32_t rope_dim = 64;   // even, at most head_dim: the trailing channels rotated
  float attention_scaling = 1.0f;  // RopeTable::attention_scaling
  float eps = 1e-6f;               // RMSNorm epsilon
  CompressorEntryFormat format = CompressorEntryFormat::kF32;

  // Batch sizes (host values: they fix the grid).
  int32_t num_requests = 0;  // at most 12,000
  int32_t num_tokens = 0;    // rows of kv / gate
  int32_t max_blocks = 0;    // grid cap (0: as much as the work needs; tests set it small to exercise the loop)

  // Device arrays.
  const float* kv = nullptr;
  const float* gate = nullptr;
  const float* ape = nullptr;
  const float* norm_weight = nullptr;
  const float* inv_freq = nullptr;
  const int32_t* start_positions = nullptr;  // [num_requests]: absolute position of the request's first token
  const int32_t* token_offsets = nullptr;    // [num_requests + 1]: rows of request r (a chunk may be empty)
  const int32_t* table_rows = nullptr;       // [num_requests] or nullptr: block-table row of request r

  PagedGroupView state;
  PagedGroupView history;

  int32_t coff() const { return overlap ? 2 : 1; }
  int32_t width() const { return coff() * head_dim; }
  int32_t state_slots() const { return coff() * ratio; }
};

// Checks the parameters on the host (cudaErrorInvalidValue when a shape or format rule above is broken) and
// launches the step on `stream`.
cudaError_t compressor_step(const CompressorStepParams& p, cudaStream_t stream);

// The grid compressor_step launches (CTAs), for benchmarks.
int compressor_step_blocks(const CompressorStepParams& p);

}  // namespace dsv4::ops::cuda
