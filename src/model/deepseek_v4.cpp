#include "model/deepseek_v4.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/hyper_connection.h"
#include "ops/cpu/indexer.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/norm.h"

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

  // h [N, hc, D]: every stream starts as the token embedding.
  std::vector<float> streams(static_cast<size_t>(N * hc * D)), next_streams(streams.size());
  for (int64_t t = 0; t < N; ++t)
    for (int64_t s = 0; s < hc; ++s)
      std::memcpy(&streams[(t * hc + s) * D], weights_.embed.ptr() + step.token_ids[t] * D, D * sizeof(float));

  const HyperConnectionParams hp{hc, D, c.hc_sinkhorn_iters, static_cast<float>(c.hc_eps),
                                 static_cast<float>(c.rms_norm_eps)};
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> collapsed(static_cast<size_t>(N * D)), sublayer_out(static_cast<size_t>(N * D));
  std::vector<float> post(static_cast<size_t>(N * hc)), comb(static_cast<size_t>(N * hc * hc));
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const LayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
    // Attention site: collapse the streams, norm, attend, expand back (mHC).
    hc_pre(hp, streams.data(), N, l.hc_attn_fn.ptr(), l.hc_attn_base.ptr(), l.hc_attn_scale.ptr(), collapsed.data(),
           post.data(), comb.data());
    rms_norm(collapsed.data(), N, D, D, l.attn_norm.ptr(), eps, collapsed.data());
    attention(layer, step, batch, collapsed.data(), sublayer_out.data());
    hc_post(hp, sublayer_out.data(), streams.data(), N, post.data(), comb.data(), next_streams.data());
    streams.swap(next_streams);
    // MoE site.
    hc_pre(hp, streams.data(), N, l.hc_ffn_fn.ptr(), l.hc_ffn_base.ptr(), l.hc_ffn_scale.ptr(), collapsed.data(),
           post.data(), comb.data());
    rms_norm(collapsed.data(), N, D, D, l.ffn_norm.ptr(), eps, collapsed.data());
    moe(layer, step, collapsed.data(), sublayer_out.data());
    hc_post(hp, sublayer_out.data(), streams.data(), N, post.data(), comb.data(), next_streams.data());
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
  hc_head(hp, selected.data(), R, weights_.hc_head_fn.ptr(), weights_.hc_head_base.ptr(), weights_.hc_head_scale.ptr(),
          final_hidden.data());
  rms_norm(final_hidden.data(), R, D, D, weights_.norm.ptr(), eps, final_hidden.data());
  Tensor logits({R, c.vocab_size});
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
  const std::vector<float> kv = project(x, N, D, w.wkv), gate = project(x, N, D, w.wgate);
  const float eps = static_cast<float>(c.rms_norm_eps);
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
        rms_norm(entry.data(), 1, p.head_dim, p.head_dim, w.norm.ptr(), eps, entry.data());
        apply_rope(entry.data(), 1, p.head_dim, 1, p.head_dim, &entry_position, rope_compress_);
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

  // Query: low-rank, weighted norm, up-projection, per-head unweighted norm, RoPE at the token position.
  std::vector<float> q_residual = project(x, N, D, l.wq_a);
  rms_norm(q_residual.data(), N, c.q_lora_rank, c.q_lora_rank, l.q_norm.ptr(), eps, q_residual.data());
  std::vector<float> q = project(q_residual.data(), N, c.q_lora_rank, l.wq_b);
  rms_norm(q.data(), N * H, d, d, nullptr, eps, q.data());
  apply_rope(q.data(), N, H * d, H, d, step.positions.data(), rope);
  // The shared K=V vector of each token.
  std::vector<float> kv = project(x, N, D, l.wkv);
  rms_norm(kv.data(), N, d, d, l.kv_norm.ptr(), eps, kv.data());
  apply_rope(kv.data(), N, d, 1, d, step.positions.data(), rope);

  // Compressed entries first: a query sees the entries its own chunk completes.
  if (type != AttentionType::kSlidingWindow) compress(layer, EntryKind::kMain, step, batch, x);
  std::vector<float> index_q, index_weights;
  const IndexerParams ip{c.index_n_heads, c.index_head_dim};
  if (type == AttentionType::kCompressedSparse) {
    compress(layer, EntryKind::kIndex, step, batch, x);
    index_q = project(q_residual.data(), N, c.q_lora_rank, l.indexer_wq_b);
    apply_rope(index_q.data(), N, ip.heads * ip.head_dim, ip.heads, ip.head_dim, step.positions.data(), rope_compress_);
    index_weights = project(x, N, D, l.indexer_weights_proj);
    const float head_scale = 1.0f / std::sqrt(static_cast<float>(ip.heads));
    for (float& weight : index_weights) weight *= head_scale;
  }

  std::vector<float> attended(static_cast<size_t>(N * H * d));
  const SinkAttentionParams ap{H, d, 1.0f / std::sqrt(static_cast<float>(d))};
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
          indexer_scores(ip, &index_q[t * ip.heads * ip.head_dim], &index_weights[t * ip.heads], index_keys.data(),
                         visible, scores.data());
          for (const int32_t e : top_k_indices(scores.data(), visible, c.index_topk))
            keys.push_back(state.entry(layer, EntryKind::kMain, e));
        }
      }
      sink_attention(ap, &q[t * H * d], keys.data(), static_cast<int64_t>(keys.size()), l.attn_sink.ptr(),
                     &attended[t * H * d]);
    }
  });
  // K=V carried RoPE into the values: rotate the output back by −t.
  apply_rope(attended.data(), N, H * d, H, d, step.positions.data(), rope, /*inverse=*/true);
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
  for (int64_t g = 0; g < G; ++g)
    linear_strided(&attended[g * group_width], N, group_width, H * d, l.wo_a.ptr() + g * o_lora * group_width, o_lora,
                   &grouped[g * o_lora], G * o_lora);
  linear(grouped.data(), N, G * o_lora, l.wo_b.ptr(), D, out);
}

void DeepseekV4Model::moe(int64_t layer, const StepLayout& step, const float* x, float* out) {
  const ModelConfig& c = config_;
  const LayerWeights& l = weights_.layers[static_cast<size_t>(layer)];
  const int64_t N = step.tokens, D = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int64_t I = c.moe_intermediate_size;
  const bool hash = c.mlp_layer_types[static_cast<size_t>(layer)] == MlpType::kHashMoe;
  std::vector<float> scores = project(x, N, D, l.gate);
  router_scores(scores.data(), N, E, router_score(c.scoring_func));
  std::vector<int32_t> chosen(static_cast<size_t>(N * K));
  std::vector<float> weights(static_cast<size_t>(N * K));
  for (int64_t t = 0; t < N; ++t)
    route_token(&scores[t * E], hash ? nullptr : l.gate_bias.ptr(), E, K,
                hash ? &l.tid2eid[static_cast<size_t>(step.token_ids[t]) * K] : nullptr,
                static_cast<float>(c.routed_scaling_factor), &chosen[t * K], &weights[t * K]);
  // Tokens grouped by expert, then one GEMM pair per expert.
  std::vector<std::vector<std::pair<int64_t, float>>> assigned(static_cast<size_t>(E));
  for (int64_t t = 0; t < N; ++t)
    for (int64_t k = 0; k < K; ++k) assigned[chosen[t * K + k]].emplace_back(t, weights[t * K + k]);
  std::fill(out, out + N * D, 0.0f);
  const float limit = static_cast<float>(c.swiglu_limit);
  std::vector<float> rows, gate_up, activated, expert_out;
  for (int64_t e = 0; e < E; ++e) {
    const auto& tokens = assigned[e];
    if (tokens.empty()) continue;
    const auto n = static_cast<int64_t>(tokens.size());
    rows.resize(static_cast<size_t>(n * D));
    for (int64_t i = 0; i < n; ++i) std::memcpy(&rows[i * D], x + tokens[i].first * D, D * sizeof(float));
    gate_up.resize(static_cast<size_t>(n * 2 * I));
    linear(rows.data(), n, D, l.experts_w13[e].ptr(), 2 * I, gate_up.data());
    activated.resize(static_cast<size_t>(n * I));
    swiglu_clamped(gate_up.data(), n, I, limit, activated.data());
    expert_out.resize(static_cast<size_t>(n * D));
    linear(activated.data(), n, I, l.experts_w2[e].ptr(), D, expert_out.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < D; ++j) out[tokens[i].first * D + j] += tokens[i].second * expert_out[i * D + j];
  }
  // The shared expert sees every token, with the same clamp.
  gate_up.resize(static_cast<size_t>(N * 2 * I));
  linear(x, N, D, l.shared_w13.ptr(), 2 * I, gate_up.data());
  activated.resize(static_cast<size_t>(N * I));
  swiglu_clamped(gate_up.data(), N, I, limit, activated.data());
  linear(activated.data(), N, I, l.shared_w2.ptr(), D, out, /*beta=*/1.0f);
}

}  // namespace dsv4
