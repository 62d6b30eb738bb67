#include "model/deepseek_v4.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/hyper_connection.h"
#include "ops/cpu/indexer.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/quantize.h"
#include "parallel/communicator.h"
#include "parallel/expert_parallel_moe.h"

namespace dsv4 {

using namespace ops::cpu;

// Flattened view of one step: token i of the batch belongs to request[i] at absolute position[i].
struct DeepseekV4Model::StepLayout {
  int64_t tokens = 0;
  std::vector<int32_t> token_ids;
  std::vector<int64_t> positions;
  std::vector<int32_t> request;
  std::vector<int64_t> offset;          // per request: first row in the flattened batch
  std::vector<int64_t> start_position;  // per request: position of its first new token
};

namespace {

ops::cpu::RopeTable make_rope(const ModelConfig& config, RopeKind kind) {
  return {config.inv_freq(kind), static_cast<float>(config.rope_for(kind).attention_factor)};
}

RouterScore router_score(ScoringFunc func) {
  switch (func) {
    case ScoringFunc::kSqrtSoftplus: return RouterScore::kSqrtSoftplus;
    case ScoringFunc::kSoftmax: return RouterScore::kSoftmax;
    case ScoringFunc::kSigmoid: return RouterScore::kSigmoid;
  }
  return RouterScore::kSqrtSoftplus;
}

// y [rows, out] = x [rows, in] · Wᵀ, allocating y.
std::vector<float> project(const float* x, int64_t rows, int64_t in, const Tensor& weight) {
  std::vector<float> y(static_cast<size_t>(rows * weight.dim(0)));
  linear(x, rows, in, weight.ptr(), weight.dim(0), y.data());
  return y;
}
std::vector<float> project(const float* x, int64_t rows, int64_t in, const LinearWeight& weight) {
  DSV4_CHECK(weight.cols() == in,
             "a " + weight.shape_string() + " projection of " + std::to_string(in) + " inputs");
  std::vector<float> y(static_cast<size_t>(rows * weight.rows()));
  linear(x, rows, weight, y.data());
  return y;
}

// ---- DeepSeek numerics (docs/numerics.md): the reference's roundings, applied only in Numerics::kDeepSeek. ----
// Every GEMM of this mode accumulates in double and rounds once to fp32 (ops::cpu::linear_f64; docs/numerics.md
// "Canonical accumulation in kDeepSeek"), as the oracle does: an fp32 BLAS rounds its partial sums in an order that
// depends on the row count, so one-shot prefill and chunked decode differed (0.031 on the tiny oracle set), and one
// flipped bf16 rounding grows into percent-level logit differences.

void bf16(std::vector<float>& x) { round_to_bf16(x.data(), static_cast<int64_t>(x.size())); }

// The K blocks of the reference's quantized GEMM kernels: fp8_gemm_kernel keeps one fp32 partial per 128 input
// channels (one 128×128 weight scale block), fp4_gemm_kernel one per 32 (one 1×32 weight scale); the partials are
// scaled and added in fp32 in block order (kernel_standin.fp8_gemm / fp4_gemm). Our dequantized weights carry the
// power-of-two scales, so each block's double sum rounded to fp32 equals the kernel's scaled partial.
constexpr int64_t kFp8GemmBlock = 128;
constexpr int64_t kFp4GemmBlock = 32;  // the routed experts (MXFP4 in the released checkpoints, §2.1)

// y [rows, out] = x · Wᵀ, double-accumulated (linear_f64), fp32 output: model.py's fp32 F.linear (compressor wkv /
// wgate, router gate, LM head).
std::vector<float> project_f64(const float* x, int64_t rows, int64_t in, const Tensor& weight, int64_t k_block = 0) {
  std::vector<float> y(static_cast<size_t>(rows * weight.dim(0)));
  linear_f64(x, rows, in, weight.ptr(), weight.dim(0), y.data(), k_block);
  return y;
}
std::vector<float> project_f64(const float* x, int64_t rows, int64_t in, const LinearWeight& weight,
                               int64_t k_block = 0) {
  DSV4_CHECK(weight.cols() == in,
             "a " + weight.shape_string() + " projection of " + std::to_string(in) + " inputs");
  std::vector<float> y(static_cast<size_t>(rows * weight.rows()));
  linear_f64(x, rows, weight, y.data(), k_block);
  return y;
}

// x [rows, width] with each row quantized per 128 columns to e4m3 (UE8M0 scales), as values: the input side
// of DeepSeek's FP8 linear. from_bf16: x rounded to bf16 first (the GPU quantizes its bf16 GEMM operand).
std::vector<float> quantized_e4m3_rows(const float* x, int64_t rows, int64_t width, bool from_bf16 = false) {
  std::vector<float> quantized(x, x + rows * width);
  if (from_bf16) round_to_bf16(quantized.data(), rows * width);
  for (int64_t r = 0; r < rows; ++r) quantize_e4m3_blocks(&quantized[r * width], width, 128);
  return quantized;
}

// The reference's linear() for an FP8 / FP4 weight (model_spec.md §3.2): each row's activation quantized per 128
// channels to e4m3 with UE8M0 scales, per-K-block double accumulation rounded to fp32 (k_block: kFp8GemmBlock or
// kFp4GemmBlock), bf16 output.
std::vector<float> project_fp8(const float* x, int64_t rows, int64_t in, const LinearWeight& weight,
                               int64_t k_block = kFp8GemmBlock) {
  std::vector<float> quantized(x, x + rows * in);
  for (int64_t r = 0; r < rows; ++r) quantize_e4m3_blocks(&quantized[r * in], in, 128);
  std::vector<float> y = project_f64(quantized.data(), rows, in, weight, k_block);
  bf16(y);
  return y;
}

// A bf16 F.linear (indexer weights_proj): bf16 operands, double accumulation rounded to fp32, bf16 output.
std::vector<float> project_bf16(const float* x, int64_t rows, int64_t in, const Tensor& weight) {
  std::vector<float> y = project_f64(x, rows, in, weight);
  bf16(y);
  return y;
}

// Σ a[i]·b[i] in double (exact products), rounded once to fp32: the oracle's einsum / sparse_attn dot products.
float dot_f64(const float* a, const float* b, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(a[i]) * b[i];
  return static_cast<float>(sum);
}

// A Python float constant `n ** -0.5` (model.py's softmax scales) as torch applies it to an fp32 / bf16 tensor:
// evaluated in double, rounded to fp32.
float inverse_sqrt_f64(double n) { return static_cast<float>(std::pow(n, -0.5)); }

// sparse_attn as the reference kernel computes it (§6.5), in the oracle's exact accumulation
// (kernel_standin.sparse_attn, EXACT): logits fp32(Σ_double q·k) · scale; p = fp32(exp(logit − m)) through double;
// l = fp32(Σ_double p) + fp32(exp(sink − m)); o = fp32(Σ_double bf16(p)·v); out = bf16(o / l). This is the kernel's
// first 64-index block; with more indices it rescales per block (docs/numerics.md "Next steps").
void sink_attention_bf16(const SinkAttentionParams& p, const float* q, const float* const* keys, int64_t num_keys,
                         const float* sinks, float* out) {
  const int64_t d = p.head_dim;
  std::vector<float> logits(static_cast<size_t>(num_keys));
  std::vector<double> acc(static_cast<size_t>(d));
  for (int64_t h = 0; h < p.heads; ++h) {
    const float* qh = q + h * d;
    float* oh = out + h * d;
    float max_logit = -INFINITY;
    for (int64_t j = 0; j < num_keys; ++j) {
      logits[j] = dot_f64(qh, keys[j], d) * p.scale;
      max_logit = std::max(max_logit, logits[j]);
    }
    double weight_sum = 0.0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t j = 0; j < num_keys; ++j) {
      const float weight = static_cast<float>(std::exp(static_cast<double>(logits[j] - max_logit)));
      weight_sum += weight;
      const double rounded = bf16_round(weight);
      for (int64_t i = 0; i < d; ++i) acc[i] += rounded * keys[j][i];
    }
    const float sink = static_cast<float>(std::exp(static_cast<double>(sinks[h] - max_logit)));
    const float denominator = static_cast<float>(weight_sum) + sink;
    for (int64_t i = 0; i < d; ++i)
      oh[i] = bf16_round(num_keys ? static_cast<float>(acc[i]) / denominator : 0.0f);
  }
}

}  // namespace

DeepseekV4Model::DeepseekV4Model(ModelConfig config, ModelWeights weights)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      rope_main_(make_rope(config_, RopeKind::kMain)),
      rope_compress_(make_rope(config_, RopeKind::kCompress)) {
  DSV4_CHECK(static_cast<int64_t>(weights_.layers.size()) == config_.num_hidden_layers,
        "weights have " + std::to_string(weights_.layers.size()) + " layers, config " +
            std::to_string(config_.num_hidden_layers));
}

void DeepseekV4Model::set_expert_parallel(parallel::Communicator* communicator) {
  DSV4_CHECK(communicator == nullptr || config_.numerics == Numerics::kHf,
             "expert parallelism runs the hf numerics only (the DeepSeek recipe's MoE is single-rank)");
  if (communicator != nullptr)
    DSV4_CHECK(communicator->size() <= config_.n_routed_experts,
               std::to_string(communicator->size()) + " expert-parallel ranks for " +
                   std::to_string(config_.n_routed_experts) + " routed experts");
  DSV4_CHECK(!remote_experts_dropped_ || (communicator != nullptr && expert_parallel_ != nullptr &&
                                          communicator->rank() == expert_parallel_->rank() &&
                                          communicator->size() == expert_parallel_->size()),
             "this model dropped the other ranks' experts: it serves only its own partition of the same group shape");
  expert_parallel_ = communicator;
}

void DeepseekV4Model::drop_remote_experts() {
  DSV4_CHECK(expert_parallel_ != nullptr, "drop_remote_experts needs expert parallelism (set_expert_parallel)");
  const parallel::ExpertPartition partition(config_.n_routed_experts, expert_parallel_->size());
  const int64_t first = partition.first_expert(expert_parallel_->rank());
  const int64_t last = first + partition.num_local(expert_parallel_->rank());
  for (LayerWeights& layer : weights_.layers)
    for (int64_t e = 0; e < static_cast<int64_t>(layer.experts_w13.size()); ++e)
      if (e < first || e >= last) {
        layer.experts_w13[static_cast<size_t>(e)] = LinearWeight();
        layer.experts_w2[static_cast<size_t>(e)] = LinearWeight();
      }
  remote_experts_dropped_ = true;
}

void DeepseekV4Model::abort_expert_parallel(const std::string& reason) {
  if (expert_parallel_ != nullptr) expert_parallel_->abort(reason);
}

std::unique_ptr<SequenceState> DeepseekV4Model::new_sequence_state() const {
  return std::make_unique<ContiguousSequenceState>(config_);
}

Tensor DeepseekV4Model::forward(std::span<const SequenceChunk> batch, LogitsMode mode) {
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size, hc = c.hc_mult;
  StepLayout step;
  for (size_t r = 0; r < batch.size(); ++r) {
    DSV4_CHECK(batch[r].state != nullptr, "batch entry " + std::to_string(r) + " has no sequence state");
    DSV4_CHECK(!batch[r].token_ids.empty(), "batch entry " + std::to_string(r) + " has no tokens");
    for (const int32_t id : batch[r].token_ids)
      DSV4_CHECK(id >= 0 && id < c.vocab_size, "token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                              std::to_string(c.vocab_size) + ")");
    step.offset.push_back(step.tokens);
    step.start_position.push_back(batch[r].state->num_tokens());
    for (size_t i = 0; i < batch[r].token_ids.size(); ++i) {
      step.token_ids.push_back(batch[r].token_ids[i]);
      step.positions.push_back(batch[r].state->num_tokens() + static_cast<int64_t>(i));
      step.request.push_back(static_cast<int32_t>(r));
    }
    step.tokens += static_cast<int64_t>(batch[r].token_ids.size());
  }
  const int64_t N = step.tokens;
  if (N == 0) {
    // Nothing of this rank's to run; an expert-parallel rank still serves the others' rows in every MoE sublayer
    // (the all-to-alls are collectives, docs/parallel.md).
    if (expert_parallel_ != nullptr)
      for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
        routed_experts_parallel(layer, nullptr, 0, {}, {}, nullptr);
    return Tensor({0, c.vocab_size});
  }

  // h [N, hc, D]: every stream starts as the token embedding.
  std::vector<float> streams(static_cast<size_t>(N * hc * D)), next_streams(streams.size());
  for (int64_t t = 0; t < N; ++t)
    for (int64_t s = 0; s < hc; ++s)
      std::memcpy(&streams[(t * hc + s) * D], weights_.embed.ptr() + step.token_ids[t] * D, D * sizeof(float));
  // kDeepSeek: the residual streams and every sublayer input are bf16 tensors (§4, §5); norms and mHC mixing
  // compute in fp32 and round their outputs.
  const bool deepseek = c.numerics == Numerics::kDeepSeek;
  auto to_bf16 = [deepseek](std::vector<float>& x) {
    if (deepseek) bf16(x);
  };
  to_bf16(streams);

  const HyperConnectionParams hp{hc, D, c.hc_sinkhorn_iters, static_cast<float>(c.hc_eps),
                                 static_cast<float>(c.rms_norm_eps)};
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> collapsed(static_cast<size_t>(N * D)), sublayer_out(static_cast<size_t>(N * D));
  std::vector<float> post(static_cast<size_t>(N * hc)), comb(static_cast<size_t>(N * hc * hc));
  // kDeepSeek: model.py's mHC with the oracle's double accumulation (ops/cpu/hyper_connection.h).
  auto mix_pre = [&](const float* fn, const float* base, const float* scale) {
    if (deepseek)
      hc_pre_deepseek(hp, c.hc_eps, streams.data(), N, fn, base, scale, collapsed.data(), post.data(), comb.data());
    else
      hc_pre(hp, streams.data(), N, fn, base, scale, collapsed.data(), post.data(), comb.data());
  };
  auto mix_post = [&] {
    (deepseek ? hc_post_deepseek : hc_post)(hp, sublayer_out.data(), streams.data(), N, post.data(), comb.data(),
                                            next_streams.data());
  };
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const LayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
    // Attention site: collapse the streams, norm, attend, expand back (mHC).
    mix_pre(l.hc_attn_fn.ptr(), l.hc_attn_base.ptr(), l.hc_attn_scale.ptr());
    to_bf16(collapsed);
    rms_norm(collapsed.data(), N, D, D, l.attn_norm.ptr(), eps, collapsed.data());
    to_bf16(collapsed);
    attention(layer, step, batch, collapsed.data(), sublayer_out.data());
    mix_post();
    to_bf16(next_streams);
    streams.swap(next_streams);
    // MoE site.
    mix_pre(l.hc_ffn_fn.ptr(), l.hc_ffn_base.ptr(), l.hc_ffn_scale.ptr());
    to_bf16(collapsed);
    rms_norm(collapsed.data(), N, D, D, l.ffn_norm.ptr(), eps, collapsed.data());
    to_bf16(collapsed);
    moe(layer, step, collapsed.data(), sublayer_out.data());
    mix_post();
    to_bf16(next_streams);
    streams.swap(next_streams);
  }
  for (size_t r = 0; r < batch.size(); ++r)
    batch[r].state->set_num_tokens(step.start_position[r] + static_cast<int64_t>(batch[r].token_ids.size()));

  // Head: collapse the streams (hc_head), final norm, LM head over the rows asked for.
  std::vector<int64_t> rows;
  if (mode == LogitsMode::kAllPositions) {
    for (int64_t t = 0; t < N; ++t) rows.push_back(t);
  } else {
    for (size_t r = 0; r < batch.size(); ++r)
      rows.push_back(step.offset[r] + static_cast<int64_t>(batch[r].token_ids.size()) - 1);
  }
  const auto R = static_cast<int64_t>(rows.size());
  std::vector<float> selected(static_cast<size_t>(R * hc * D));
  for (int64_t i = 0; i < R; ++i)
    std::memcpy(&selected[i * hc * D], &streams[rows[i] * hc * D], hc * D * sizeof(float));
  std::vector<float> final_hidden(static_cast<size_t>(R * D));
  (deepseek ? hc_head_deepseek : hc_head)(hp, selected.data(), R, weights_.hc_head_fn.ptr(),
                                          weights_.hc_head_base.ptr(), weights_.hc_head_scale.ptr(), final_hidden.data());
  to_bf16(final_hidden);
  rms_norm(final_hidden.data(), R, D, D, weights_.norm.ptr(), eps, final_hidden.data());
  to_bf16(final_hidden);  // the fp32 LM head then reads bf16 values (§4 step 3)
  Tensor logits({R, c.vocab_size});
  if (deepseek)  // model.py's fp32 F.linear, double-accumulated as in the oracle
    linear_f64(final_hidden.data(), R, D, weights_.head.ptr(), c.vocab_size, logits.ptr());
  else
    linear(final_hidden.data(), R, D, weights_.head.ptr(), c.vocab_size, logits.ptr());
  return logits;
}

void DeepseekV4Model::compress(int64_t layer, EntryKind kind, const StepLayout& step,
                               std::span<const SequenceChunk> batch, const float* x) {
  const ModelConfig& c = config_;
  const LayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
  const CompressorWeights& w = kind == EntryKind::kMain ? l.compressor : l.indexer_compressor;
  const CompressorParams p{kind == EntryKind::kMain ? c.compress_rate(layer) : c.compress_rate_csa,
                           kind == EntryKind::kMain ? c.head_dim : c.index_head_dim,
                           c.layer_types[static_cast<size_t>(layer)] == AttentionType::kCompressedSparse};
  const int64_t N = step.tokens, D = c.hidden_size, width = p.width();
  const bool deepseek = c.numerics == Numerics::kDeepSeek;
  // kDeepSeek: model.py's fp32 F.linear of x.float(), double-accumulated as in the oracle.
  auto fp32_linear = [&](const Tensor& weight) {
    return deepseek ? project_f64(x, N, D, weight) : project(x, N, D, weight);
  };
  const std::vector<float> kv = fp32_linear(w.wkv), gate = fp32_linear(w.wgate);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t rope_dim = rope_compress_.rope_dim();
  // Requests are independent; within one, tokens enter the compressor in order.
  ThreadPool::global().parallel_for(static_cast<int64_t>(batch.size()), [&](int64_t begin, int64_t end) {
    std::vector<float> entry(static_cast<size_t>(p.head_dim));
    for (int64_t r = begin; r < end; ++r) {
      SequenceState& state = *batch[r].state;
      float* kv_state = state.compressor_kv_state(layer, kind);
      float* gate_state = state.compressor_gate_state(layer, kind);
      for (size_t i = 0; i < batch[r].token_ids.size(); ++i) {
        const int64_t row = step.offset[r] + static_cast<int64_t>(i), position = step.positions[row];
        if (!compressor_append(p, kv_state, gate_state, &kv[row * width], &gate[row * width], w.ape.ptr(), position,
                               entry.data()))
          continue;
        // Entry w = position / ratio: RMSNorm, then RoPE at the window's first position w·ratio.
        const int64_t entry_position = position / p.ratio * p.ratio;
        if (deepseek) {
          finish_entry_deepseek(entry.data(), p.head_dim, w.norm.ptr(), eps, entry_position, rope_compress_,
                                kind == EntryKind::kIndex);
          std::memcpy(state.append_entry(layer, kind), entry.data(), entry.size() * sizeof(float));
          continue;
        }
        rms_norm(entry.data(), 1, p.head_dim, p.head_dim, w.norm.ptr(), eps, entry.data());
        apply_rope(entry.data(), 1, p.head_dim, 1, p.head_dim, &entry_position, rope_compress_);
        if (c.fp8_kv_cache) {
          // The GPU's FP8 entry of this fp32 entry (ops/cuda/compressor.h kFp8Main / kFp8Index): bf16, then the
          // main entry's no-rope channels quantized per 64, an index key as one block with its own scale (§3.3,
          // cache/index_key_format.h).
          round_to_bf16(entry.data(), p.head_dim);
          if (kind == EntryKind::kMain) quantize_e4m3_blocks(entry.data(), p.head_dim - rope_dim, 64);
          else quantize_e4m3_blocks(entry.data(), p.head_dim, p.head_dim);
        }
        std::memcpy(state.append_entry(layer, kind), entry.data(), entry.size() * sizeof(float));
      }
    }
  });
}

void DeepseekV4Model::attention(int64_t layer, const StepLayout& step, std::span<const SequenceChunk> batch,
                                const float* x, float* out) {
  const ModelConfig& c = config_;
  const LayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
  const AttentionType type = c.layer_types[static_cast<size_t>(layer)];
  const RopeTable& rope = c.rope_kind(layer) == RopeKind::kMain ? rope_main_ : rope_compress_;
  const int64_t N = step.tokens, D = c.hidden_size, H = c.num_attention_heads, d = c.head_dim;
  const int64_t W = c.sliding_window, ratio = c.compress_rate(layer);
  const float eps = static_cast<float>(c.rms_norm_eps);

  // kDeepSeek: FP8 linears quantize their input (project_fp8), every intermediate is a bf16 tensor (to_bf16).
  const bool deepseek = c.numerics == Numerics::kDeepSeek;
  auto to_bf16 = [deepseek](std::vector<float>& v) {
    if (deepseek) bf16(v);
  };
  const bool fp8_activations = !deepseek && c.fp8_activations != Fp8Activations::kOff;
  const bool fp8_from_bf16 = c.fp8_activations == Fp8Activations::kFromBf16;
  auto fp8_linear = [deepseek, fp8_activations, fp8_from_bf16](const float* in, int64_t rows, int64_t width,
                                                               const LinearWeight& weight) {
    if (fp8_activations && weight.encoding() == WeightEncoding::kF8E4M3)
      return project(quantized_e4m3_rows(in, rows, width, fp8_from_bf16).data(), rows, width, weight);
    return deepseek ? project_fp8(in, rows, width, weight) : project(in, rows, width, weight);
  };
  // Query: low-rank, weighted norm, up-projection, per-head unweighted norm, RoPE at the token position.
  std::vector<float> q_residual = fp8_linear(x, N, D, l.wq_a);
  rms_norm(q_residual.data(), N, c.q_lora_rank, c.q_lora_rank, l.q_norm.ptr(), eps, q_residual.data());
  to_bf16(q_residual);
  std::vector<float> q = fp8_linear(q_residual.data(), N, c.q_lora_rank, l.wq_b);
  if (deepseek) head_rms_norm_bf16(q.data(), N * H, d, eps);
  else rms_norm(q.data(), N * H, d, d, nullptr, eps, q.data());
  apply_rope(q.data(), N, H * d, H, d, step.positions.data(), rope);
  to_bf16(q);
  // The shared K=V vector of each token.
  std::vector<float> kv = fp8_linear(x, N, D, l.wkv);
  rms_norm(kv.data(), N, d, d, l.kv_norm.ptr(), eps, kv.data());
  to_bf16(kv);
  apply_rope(kv.data(), N, d, 1, d, step.positions.data(), rope);
  to_bf16(kv);
  // FP8 simulation of the non-rope channels, one UE8M0 scale per 64 (§3.3, §6.2): DeepSeek's numerics, or the
  // twin of the GPU's FP8 cache (its entries are the bf16 K=V rows quantized; the step's own rows too).
  if (!deepseek && c.fp8_kv_cache) bf16(kv);
  if (deepseek || c.fp8_kv_cache)
    for (int64_t t = 0; t < N; ++t) quantize_e4m3_blocks(&kv[t * d], d - rope.rope_dim(), 64);

  // Compressed entries first: a query sees the entries its own chunk completes.
  if (type != AttentionType::kSlidingWindow) compress(layer, EntryKind::kMain, step, batch, x);
  std::vector<float> index_q, index_weights;
  const IndexerParams ip{c.index_n_heads, c.index_head_dim};
  if (type == AttentionType::kCompressedSparse) {
    compress(layer, EntryKind::kIndex, step, batch, x);
    index_q = fp8_linear(q_residual.data(), N, c.q_lora_rank, l.indexer_wq_b);
    apply_rope(index_q.data(), N, ip.heads * ip.head_dim, ip.heads, ip.head_dim, step.positions.data(), rope_compress_);
    if (deepseek) {  // Hadamard rotation, then FP4 simulation per 32 (§3.5, §8 step 3)
      const float scale = inverse_sqrt_f64(static_cast<double>(ip.head_dim));  // rotate_activation's n ** -0.5
      for (int64_t row = 0; row < N * ip.heads; ++row) hadamard_fp4(&index_q[row * ip.head_dim], ip.head_dim, scale, 32);
    }
    index_weights = deepseek ? project_bf16(x, N, D, l.indexer_weights_proj) : project(x, N, D, l.indexer_weights_proj);
    // kDeepSeek folds index_head_dim^-0.5 into the weights (a bf16 product, §8 step 5; model.py's
    // `softmax_scale * n_heads ** -0.5`, a double product applied as fp32); kHf applies it per score.
    const float head_scale =
        deepseek ? static_cast<float>(std::pow(static_cast<double>(ip.head_dim), -0.5) *
                                      std::pow(static_cast<double>(ip.heads), -0.5))
                 : 1.0f / std::sqrt(static_cast<float>(ip.heads));
    for (float& weight : index_weights) weight *= head_scale;
    to_bf16(index_weights);
  }

  std::vector<float> attended(static_cast<size_t>(N * H * d));
  const SinkAttentionParams ap{H, d,
                               deepseek ? inverse_sqrt_f64(static_cast<double>(d))  // model.py head_dim ** -0.5
                                        : 1.0f / std::sqrt(static_cast<float>(d))};
  ThreadPool::global().parallel_for(N, [&](int64_t begin, int64_t end) {
    std::vector<const float*> keys;
    std::vector<float> scores;
    std::vector<const float*> index_keys;
    for (int64_t t = begin; t < end; ++t) {
      const int32_t r = step.request[t];
      SequenceState& state = *batch[r].state;
      const int64_t position = step.positions[t], chunk_start = step.start_position[r];
      keys.clear();
      // Raw window: positions t−W+1 … t, from this chunk or from the stored window.
      for (int64_t p = std::max<int64_t>(0, position - W + 1); p <= position; ++p)
        keys.push_back(p >= chunk_start ? &kv[(step.offset[r] + p - chunk_start) * d] : state.window_kv(layer, p));
      if (type != AttentionType::kSlidingWindow) {
        // Entry w is complete, hence visible, iff w < (t+1) div ratio.
        const int64_t visible = (position + 1) / ratio;
        if (type == AttentionType::kHeavilyCompressed) {
          for (int64_t e = 0; e < visible; ++e) keys.push_back(state.entry(layer, EntryKind::kMain, e));
        } else if (visible > 0) {
          index_keys.resize(static_cast<size_t>(visible));
          scores.resize(static_cast<size_t>(visible));
          for (int64_t e = 0; e < visible; ++e) index_keys[e] = state.entry(layer, EntryKind::kIndex, e);
          (deepseek ? indexer_scores_bf16 : indexer_scores)(ip, &index_q[t * ip.heads * ip.head_dim],
                                                            &index_weights[t * ip.heads], index_keys.data(), visible,
                                                            scores.data());
          for (const int32_t e : top_k_indices(scores.data(), visible, c.index_topk))
            keys.push_back(state.entry(layer, EntryKind::kMain, e));
        }
      }
      (deepseek ? sink_attention_bf16 : sink_attention)(ap, &q[t * H * d], keys.data(), static_cast<int64_t>(keys.size()), l.attn_sink.ptr(),
                     &attended[t * H * d]);
    }
  });
  // K=V carried RoPE into the values: rotate the output back by −t.
  apply_rope(attended.data(), N, H * d, H, d, step.positions.data(), rope, /*inverse=*/true);
  to_bf16(attended);
  // The window keeps the last W raw K=V vectors of every request (written after all reads of this step).
  for (size_t r = 0; r < batch.size(); ++r) {
    const auto length = static_cast<int64_t>(batch[r].token_ids.size());
    const int64_t start = step.start_position[r], end_position = start + length;
    for (int64_t p = std::max(start, end_position - W); p < end_position; ++p)
      std::memcpy(batch[r].state->window_kv(layer, p), &kv[(step.offset[r] + p - start) * d], d * sizeof(float));
  }
  // Grouped output projection: group g's heads → o_lora_rank through rows [g·o_lora, (g+1)·o_lora) of wo_a.
  const int64_t G = c.o_groups, group_width = H * d / G, o_lora = c.o_lora_rank;
  std::vector<float> grouped(static_cast<size_t>(N * G * o_lora));
  for (int64_t g = 0; g < G; ++g) {
    const float* group_in = &attended[g * group_width];
    if (deepseek)  // the einsum double-accumulated, as in the oracle
      linear_f64_strided(group_in, N, H * d, l.wo_a, g * o_lora, o_lora, &grouped[g * o_lora], G * o_lora);
    else
      linear_strided(group_in, N, H * d, l.wo_a, g * o_lora, o_lora, &grouped[g * o_lora], G * o_lora);
  }
  if (!deepseek) {
    if (fp8_activations && l.wo_b.encoding() == WeightEncoding::kF8E4M3)
      grouped = quantized_e4m3_rows(grouped.data(), N, G * o_lora, fp8_from_bf16);
    linear(grouped.data(), N, l.wo_b, out);
    return;
  }
  // kDeepSeek: wo_a is a bf16 einsum without activation quantization (§2.1, §6.6); wo_b an FP8 linear.
  bf16(grouped);
  const std::vector<float> projected = project_fp8(grouped.data(), N, G * o_lora, l.wo_b);
  std::copy(projected.begin(), projected.end(), out);
}

void DeepseekV4Model::moe(int64_t layer, const StepLayout& step, const float* x, float* out) {
  const ModelConfig& c = config_;
  const LayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
  const int64_t N = step.tokens, D = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int64_t I = c.moe_intermediate_size;
  const bool hash = c.mlp_layer_types[static_cast<size_t>(layer)] == MlpType::kHashMoe;
  const bool deepseek = c.numerics == Numerics::kDeepSeek;
  std::vector<float> scores = deepseek ? project_f64(x, N, D, l.gate) : project(x, N, D, l.gate);
  if (deepseek && c.scoring_func == ScoringFunc::kSqrtSoftplus) {
    // Gate.forward: F.softplus (threshold 20) evaluated in double and rounded once (the oracle's one-rounding
    // softplus, docs/numerics.md "The oracle"), then the fp32 sqrt.
    for (float& score : scores) {
      const double v = score;
      score = std::sqrt(static_cast<float>(v > 20.0 ? v : std::log1p(std::exp(v))));
    }
  } else {
    router_scores(scores.data(), N, E, router_score(c.scoring_func));
  }
  std::vector<int32_t> chosen(static_cast<size_t>(N * K));
  std::vector<float> weights(static_cast<size_t>(N * K));
  for (int64_t t = 0; t < N; ++t)
    route_token(&scores[t * E], hash ? nullptr : l.gate_bias.ptr(), E, K,
                hash ? &l.tid2eid[static_cast<size_t>(step.token_ids[t]) * K] : nullptr,
                static_cast<float>(c.routed_scaling_factor), &chosen[t * K], &weights[t * K]);
  std::fill(out, out + N * D, 0.0f);
  const float limit = static_cast<float>(c.swiglu_limit);
  ExpertScratch scratch;
  if (expert_parallel_ != nullptr) {
    routed_experts_parallel(layer, x, N, chosen, weights, out);  // kHf only (set_expert_parallel)
  } else {
    // Tokens grouped by expert, then one GEMM pair per expert.
    std::vector<std::vector<std::pair<int64_t, float>>> assigned(static_cast<size_t>(E));
    for (int64_t t = 0; t < N; ++t)
      for (int64_t k = 0; k < K; ++k) assigned[chosen[t * K + k]].emplace_back(t, weights[t * K + k]);
    if (deepseek) {
      moe_deepseek(layer, N, x, assigned, out);
      return;
    }
    std::vector<float> rows;
    for (int64_t e = 0; e < E; ++e) {
      const auto& tokens = assigned[e];
      if (tokens.empty()) continue;
      const auto n = static_cast<int64_t>(tokens.size());
      rows.resize(static_cast<size_t>(n * D));
      for (int64_t i = 0; i < n; ++i) std::memcpy(&rows[i * D], x + tokens[i].first * D, D * sizeof(float));
      routed_expert(layer, e, rows.data(), n, scratch);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < D; ++j) out[tokens[i].first * D + j] += tokens[i].second * scratch.out[i * D + j];
    }
  }
  // The shared expert sees every token, with the same clamp.
  std::vector<float>& gate_up = scratch.gate_up;
  std::vector<float>& activated = scratch.activated;
  gate_up.resize(static_cast<size_t>(N * 2 * I));
  linear(x, N, l.shared_w13, gate_up.data());
  activated.resize(static_cast<size_t>(N * I));
  swiglu_clamped(gate_up.data(), N, I, limit, activated.data());
  linear(activated.data(), N, l.shared_w2, out, /*beta=*/1.0f);
}

void DeepseekV4Model::routed_expert(int64_t layer, int64_t e, const float* rows, int64_t n,
                                    ExpertScratch& scratch) const {
  const ModelConfig& c = config_;
  const LayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  scratch.gate_up.resize(static_cast<size_t>(n * 2 * I));
  scratch.activated.resize(static_cast<size_t>(n * I));
  scratch.out.resize(static_cast<size_t>(n * D));
  linear(rows, n, l.experts_w13[e], scratch.gate_up.data());
  swiglu_clamped(scratch.gate_up.data(), n, I, static_cast<float>(c.swiglu_limit), scratch.activated.data());
  linear(scratch.activated.data(), n, l.experts_w2[e], scratch.out.data());
}

void DeepseekV4Model::routed_experts_parallel(int64_t layer, const float* x, int64_t tokens,
                                              std::span<const int32_t> chosen, std::span<const float> weights,
                                              float* out) {
  // This rank's tokens go to the experts' owners; this rank runs its partition's experts for every rank.
  const ModelConfig& c = config_;
  const int64_t D = c.hidden_size;
  const parallel::ExpertPartition partition(c.n_routed_experts, expert_parallel_->size());
  const int64_t first = partition.first_expert(expert_parallel_->rank());
  ExpertScratch scratch;
  parallel::expert_parallel_moe(
      *expert_parallel_, partition, D, c.num_experts_per_tok, x, tokens, chosen, weights,
      [&](int64_t local, const float* rows, int64_t n, const float* row_weights, float* partial) {
        routed_expert(layer, first + local, rows, n, scratch);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < D; ++j) partial[i * D + j] += row_weights[i] * scratch.out[i * D + j];
      },
      out);
}

// MoE.forward of the reference (§9 step 5–7): the expert input quantized per 128 (one quantization serves w1 and
// w3), gate/up bf16 then fp32, clamped SwiGLU times the routing weight in fp32, rounded to bf16, w2 (FP8/FP4
// linear) to bf16, accumulated in fp32 in expert order, the shared expert last, the sum rounded to bf16.
void DeepseekV4Model::moe_deepseek(int64_t layer, int64_t tokens, const float* x,
                                   const std::vector<std::vector<std::pair<int64_t, float>>>& assigned, float* out) {
  const ModelConfig& c = config_;
  const LayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  const float limit = static_cast<float>(c.swiglu_limit);
  // Routed experts are FP4 (per-32 GEMM partials), the shared expert FP8 (per-128), as in the released checkpoints.
  auto expert = [&](const float* rows, int64_t n, const LinearWeight& w13, const LinearWeight& w2,
                    const float* weights, int64_t k_block) {
    std::vector<float> gate_up = project_fp8(rows, n, D, w13, k_block);
    std::vector<float> activated(static_cast<size_t>(n * I));
    swiglu_clamped(gate_up.data(), n, I, limit, activated.data());
    if (weights)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < I; ++j) activated[i * I + j] *= weights[i];
    bf16(activated);
    return project_fp8(activated.data(), n, I, w2, k_block);
  };
  std::vector<float> rows, weights;
  for (size_t e = 0; e < assigned.size(); ++e) {
    const auto& tokens = assigned[e];
    if (tokens.empty()) continue;
    const auto n = static_cast<int64_t>(tokens.size());
    rows.resize(static_cast<size_t>(n * D));
    weights.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&rows[i * D], x + tokens[i].first * D, D * sizeof(float));
      weights[i] = tokens[i].second;
    }
    const std::vector<float> y = expert(rows.data(), n, l.experts_w13[e], l.experts_w2[e], weights.data(),
                                         kFp4GemmBlock);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < D; ++j) out[tokens[i].first * D + j] += y[i * D + j];
  }
  const std::vector<float> shared = expert(x, tokens, l.shared_w13, l.shared_w2, nullptr, kFp8GemmBlock);
  for (int64_t i = 0; i < tokens * D; ++i) out[i] = bf16_round(out[i] + shared[i]);
}

}  // namespace dsv4
