// Sampling on the device: the CUDA twin of engine/sampler.cpp's `sample` for a batch of rows of fp32 logits
// [rows, vocab] (vLLM v1 semantics, sampler.h steps 1-7). Only the token ids and the requested logprobs come back.
//
// The generator stays on the host: the caller draws u in [0, 1) from each request's mt19937_64 exactly as the CPU
// sampler does (dsv4::draw_uniform, one draw per sampled token, none for greedy) and passes it in the row's
// parameters, so a seeded request gets the same token on the CPU and on the device.
//
// Equality with the CPU sampler. Every float operation of steps 1-5 (min_tokens, penalties, temperature, min_p,
// top_k) is the CPU's, bit for bit: same IEEE operations in the same order, no contraction. The weights of step 6-7
// (top_p, the draw) are exp(l - l_max), which the CPU sums in double; the device rounds each to a 2^-45 fixed
// point (sampling_fixed_weight) and sums integers, so every sum is exact and independent of the summation order,
// and the chosen token is the CPU's unless u · total or top_p · total falls within ~1e-13 (relative) of a
// cumulative sum: a genuine floating-point tie. Ties of logits go to the lower index everywhere (greedy, top_k,
// the descending order of top_p). −inf is never sampled (unless every logit is −inf: token 0, as on the CPU).
// The order the draw walks the kept tokens in is the CPU's: descending (logit, then lower index) when top_p < 1,
// ascending index otherwise (engine/sampler.cpp sorts a top_k-only set by index for that).
//
// Logprobs (vLLM's raw_logprobs): the log-softmax of the raw logits, the sampled token's logprob and rank, and the
// top N (N <= 20) ids and logprobs, as SampleResult holds them.
//
// How it runs (no allocation, no host synchronisation: CUDA-graph safe; every kernel reads what it needs from the
// device arrays, so a captured graph replays with new parameters uploaded in place; the first call sets the row
// kernels' shared-memory attribute once, so make a warm-up call before capturing):
//   1. chunk pass, CTAs of 8,192 logits: the argmax (a lean kernel for rows with nothing else to do) and, in a
//      second kernel (`chunk_extras`), min_tokens and penalties (token counts of the history, built in shared
//      memory), the raw log-sum-exp pieces and top-N for logprobs, and for 0 < top_k <= 128 a superset of each
//      chunk's top-k: the tokens above a threshold found by bisection whose count lies in [k, 4096 / chunks]
//      (an exact radix select when ties defeat it); penalised sampling rows write their processed row out.
//   2. row pass, one CTA per row: greedy rows and top-N finish here; top_k <= 128 rows sort the chunks' lists
//      (<= 4,096 tokens), keep k and do min_p, top_p and the draw in shared memory.
//   Rows with top_k off (or > 128) continue (only launched when `full_path`):
//   3. chunk pass: each candidate's fixed-point weight, binned by (l_max - l) in 1/32-nat bins (top_p < 1) or
//      summed per chunk (top_p = 1);
//   4. row pass: top_p's boundary and the draw from the bins' cumulative weights; only the tokens of the one or
//      two bins that hold the boundary and the draw are gathered and sorted (<= 4,096; a bin with more is split by
//      an exact radix select over (logit, index) first), so the vocabulary is never sorted. top_k > 128 is found
//      by the same radix select in pass 2. With top_p = 1 the draw walks the one chunk its cumulative sum falls in.
//   5. rank pass (only launched when `logprobs`): 1 + the number of raw logits above the sampled token's.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

inline constexpr int kSamplingMaxLogprobs = 20;
inline constexpr int64_t kSamplingMaxVocab = 262144;  // 2^18: fixed-point sums of 2^45-scaled weights fit 63 bits
inline constexpr int64_t kSamplingMaxRows = 65535;
inline constexpr int kSamplingTopKFast = 128;  // top_k up to this is merged in shared memory (pass 2)

// SamplingRow::flags.
inline constexpr uint32_t kSampleGreedy = 1u;      // temperature < 1e-5: argmax of the penalised logits
inline constexpr uint32_t kSampleMinP = 2u;        // min_p > 0: log_min_p is used
inline constexpr uint32_t kSampleRepetition = 4u;  // repetition_penalty != 1 over history [begin, end)
inline constexpr uint32_t kSampleFreqPres = 8u;    // frequency/presence over history [prompt_end, end)
inline constexpr uint32_t kSampleMinTokens = 16u;  // the stop ids [stop_begin, stop_end) are set to −inf
inline constexpr uint32_t kSampleLogprobs = 32u;   // SamplingOutput gets logprob, rank and num_logprobs top

// One row's parameters (POD; an array of them is uploaded). pack_sampling_row below fills it from the request.
struct SamplingRow {
  double u = 0.0;      // uniform in [0, 1) drawn from the request's generator (ignored for greedy rows)
  double top_p = 1.0;  // < 1: top_p on
  double frequency_penalty = 0.0;
  double presence_penalty = 0.0;
  float inv_temperature = 0.0f;     // float(1.0 / temperature), as the CPU computes it
  float log_min_p = 0.0f;           // float(std::log(min_p)), with kSampleMinP
  float repetition_penalty = 1.0f;  // float(repetition_penalty)
  int32_t top_k = 0;                // <= 0: off
  uint32_t flags = kSampleGreedy;
  int32_t num_logprobs = 0;  // N in [0, 20] with kSampleLogprobs
  // The token history in SamplingArgs::history: [history_begin, history_prompt_end) count for the repetition
  // penalty only, [history_prompt_end, history_end) are output tokens (repetition and frequency/presence).
  int32_t history_begin = 0, history_prompt_end = 0, history_end = 0;
  int32_t stop_begin = 0, stop_end = 0;  // min_tokens suppression ids in SamplingArgs::stop_ids
};

// One row's result (POD; the caller copies the array back). logprob, rank and top only with kSampleLogprobs.
struct SamplingOutput {
  int32_t token = -1;
  float logprob = 0.0f;  // of `token` under the raw distribution
  int32_t rank = 0;      // 1 + the number of raw logits strictly above the token's
  int32_t num_top = 0;   // min(N, vocab)
  int32_t top_ids[kSamplingMaxLogprobs] = {};  // descending raw logit, the lower index first on ties
  float top_logprobs[kSamplingMaxLogprobs] = {};
};

struct SamplingArgs {
  const float* logits = nullptr;  // device [rows, logits_stride], fp32, the first `vocab` of each row used
  int64_t rows = 0, vocab = 0, logits_stride = 0;
  const SamplingRow* params = nullptr;  // device [rows]
  const int32_t* history = nullptr;     // device, flat token ids the rows index (may be null if none)
  const int32_t* stop_ids = nullptr;    // device, flat stop ids the rows index (may be null if none)
  SamplingOutput* out = nullptr;        // device [rows]
  // Launch plan: `chunk_extras` launches pass 1's second kernel (needed by any row with penalties, min_tokens,
  // logprobs or 0 < top_k <= 128), `full_path` passes 3-4 (any sampled row with top_k off or > 128), `logprobs`
  // pass 5 (any row with kSampleLogprobs). A row that needs none costs nothing in them, so for a CUDA graph that
  // must serve any batch leave all true; pack_sampling_row computes the minimal plan.
  bool chunk_extras = true;
  bool full_path = true;
  bool logprobs = true;
};

// Bytes of workspace sample_tokens needs for up to `rows` rows of `vocab` logits (about rows · vocab · 6 bytes:
// the processed row of penalised sampling rows and the per-chunk histograms).
size_t sampling_workspace_bytes(int64_t rows, int64_t vocab);

// Samples one token per row; see the top of the file. Invalid shapes or a short workspace: cudaErrorInvalidValue.
cudaError_t sample_tokens(const SamplingArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The fixed-point weight the device gives a tempered logit t against the row's maximum: round(exp(t − max) · 2^45)
// (0 when t − max < −33), computed with a table-driven double exp accurate to ~1e-16 relative; exposed for tests.
uint64_t sampling_fixed_weight(float t, float max);

}  // namespace dsv4::ops::cuda

// ---- Host-side packing (C++20; not part of the CUDA translation units, which are C++17) ------------------------
#if __cplusplus >= 202002L
#include <algorithm>
#include <climits>
#include <cmath>
#include <span>
#include <vector>

#include "engine/request.h"
#include "engine/sampler.h"

namespace dsv4::ops::cuda {

// A batch of rows' parameters as the device reads them: pack, upload rows / history / stop_ids, launch, download.
struct SamplingBatch {
  std::vector<SamplingRow> rows;
  std::vector<int32_t> history;   // SamplingArgs::history
  std::vector<int32_t> stop_ids;  // SamplingArgs::stop_ids
  bool needs_chunk_extras = false;  // SamplingArgs::chunk_extras for this batch
  bool needs_full_path = false;     // SamplingArgs::full_path for this batch
  bool needs_logprobs = false;      // SamplingArgs::logprobs for this batch
  void clear() {
    rows.clear();
    history.clear();
    stop_ids.clear();
    needs_chunk_extras = needs_full_path = needs_logprobs = false;
  }
};

// Appends one row for a request whose tokens so far are `prompt_and_output`, exactly as engine/sampler.cpp's
// `sample` would process it, and draws its u from `state` (the request's generator: one draw for a sampled row,
// none for a greedy one, as the CPU sampler). The history carries only what the penalties read.
// Differs from the CPU in one degenerate case only: when every tempered logit is −inf the CPU returns token 0
// without drawing, while the draw here has already happened.
inline void pack_sampling_row(SamplingBatch& batch, const SamplingParams& params, RequestSamplerState& state,
                              std::span<const int32_t> prompt_and_output) {
  SamplingRow row;
  const auto size = static_cast<int64_t>(prompt_and_output.size());
  const bool greedy = params.temperature < kGreedyTemperature;
  row.flags = greedy ? kSampleGreedy : 0u;
  if (!greedy) {
    row.inv_temperature = static_cast<float>(1.0 / params.temperature);
    row.u = draw_uniform(state);
    row.top_k = params.top_k > 0 ? static_cast<int32_t>(std::min<int64_t>(params.top_k, INT32_MAX)) : 0;
    row.top_p = params.top_p;
    if (params.min_p > 0.0) {
      row.flags |= kSampleMinP;
      row.log_min_p = static_cast<float>(std::log(params.min_p));
    }
    if (row.top_k <= 0 || row.top_k > kSamplingTopKFast)
      batch.needs_full_path = true;
    else
      batch.needs_chunk_extras = true;
  }
  const int64_t num_output = size - state.num_prompt_tokens;
  if (num_output < params.min_tokens && !state.min_tokens_stop_ids.empty()) {
    row.flags |= kSampleMinTokens;
    row.stop_begin = static_cast<int32_t>(batch.stop_ids.size());
    batch.stop_ids.insert(batch.stop_ids.end(), state.min_tokens_stop_ids.begin(), state.min_tokens_stop_ids.end());
    row.stop_end = static_cast<int32_t>(batch.stop_ids.size());
  }
  const bool repetition = params.repetition_penalty != 1.0;
  const bool freq_pres = params.frequency_penalty != 0.0 || params.presence_penalty != 0.0;
  row.repetition_penalty = static_cast<float>(params.repetition_penalty);
  row.frequency_penalty = params.frequency_penalty;
  row.presence_penalty = params.presence_penalty;
  const auto first_output = static_cast<size_t>(std::clamp<int64_t>(state.num_prompt_tokens, 0, size));
  row.history_begin = row.history_prompt_end = row.history_end = static_cast<int32_t>(batch.history.size());
  if (repetition || freq_pres) {
    if (repetition) {
      row.flags |= kSampleRepetition;
      batch.history.insert(batch.history.end(), prompt_and_output.begin(),
                           prompt_and_output.begin() + static_cast<std::ptrdiff_t>(first_output));
    }
    if (freq_pres) row.flags |= kSampleFreqPres;
    row.history_prompt_end = static_cast<int32_t>(batch.history.size());
    batch.history.insert(batch.history.end(), prompt_and_output.begin() + static_cast<std::ptrdiff_t>(first_output),
                         prompt_and_output.end());
    row.history_end = static_cast<int32_t>(batch.history.size());
  }
  if (row.flags & (kSampleMinTokens | kSampleRepetition | kSampleFreqPres)) batch.needs_chunk_extras = true;
  if (params.logprobs) {
    row.flags |= kSampleLogprobs;
    row.num_logprobs = static_cast<int32_t>(std::clamp<int64_t>(*params.logprobs, 0, kSamplingMaxLogprobs));
    batch.needs_logprobs = batch.needs_chunk_extras = true;
  }
  batch.rows.push_back(row);
}

// The SampleResult of one downloaded row (meaningful with kSampleLogprobs; the token always).
inline SampleResult to_sample_result(const SamplingOutput& out) {
  SampleResult r;
  r.token = out.token;
  r.logprob = out.logprob;
  r.rank = out.rank;
  for (int i = 0; i < out.num_top; ++i) r.top.push_back({out.top_ids[i], out.top_logprobs[i]});
  return r;
}

}  // namespace dsv4::ops::cuda
#endif
