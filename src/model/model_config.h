// ModelConfig: every field of a DeepSeek-V4 HF config.json (model_type "deepseek_v4"), resolved the way
// transformers 5.17 `DeepseekV4Config.__post_init__` resolves it (legacy keys folded in, defaults filled,
// rope parameters split into the "main" and "compress" types). See docs/MODEL.md (shared) and
// docs/model_config.md.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dsv4 {

enum class AttentionType {
  kSlidingWindow,       // "sliding_attention": the raw-token window only
  kCompressedSparse,    // "compressed_sparse_attention" (CSA): overlapping compressor + indexer top-k
  kHeavilyCompressed,   // "heavily_compressed_attention" (HCA): non-overlapping compressor, read densely
};
enum class MlpType { kHashMoe, kMoe };
enum class ScoringFunc { kSqrtSoftplus, kSoftmax, kSigmoid };
enum class RopeKind { kMain, kCompress };  // SWA layers use main; CSA/HCA layers use compress for everything
// Input quantization of the FP8-stored projections in kHf (ModelConfig::fp8_activations).
enum class Fp8Activations { kOff, kFromFp32, kFromBf16 };

// Numerical recipe of the CPU forward (docs/numerics.md). kHf: transformers' exact fp32 math (the default).
// kDeepSeek: DeepSeek's own inference code — bf16 activations, FP8 activation quantization for every FP8/FP4
// linear, FP8-simulated KV entries, Hadamard + FP4-simulated indexer (model_spec.md §3.2, §3.3, §3.5, §8).
enum class Numerics { kHf, kDeepSeek };

const char* attention_type_name(AttentionType type);
const char* mlp_type_name(MlpType type);

// One rope type's parameters, as HF keeps them in config.rope_parameters["main" | "compress"].
struct RopeParameters {
  std::string rope_type = "default";  // "default" or "yarn"
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;
  // YaRN (transformers `_compute_yarn_parameters`); unused for "default".
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0, beta_slow = 1.0;
  double attention_factor = 1.0;  // cos/sin multiplier; DeepSeek-V4 forces 1.0 for yarn
};

struct ModelConfig {
  int64_t vocab_size = 129280;
  int64_t hidden_size = 4096;
  int64_t moe_intermediate_size = 2048;
  int64_t num_hidden_layers = 43;
  int64_t num_attention_heads = 64;
  int64_t num_key_value_heads = 1;
  int64_t head_dim = 512;
  int64_t q_lora_rank = 1024;
  int64_t num_experts_per_tok = 6;
  int64_t n_routed_experts = 256;
  int64_t n_shared_experts = 1;
  ScoringFunc scoring_func = ScoringFunc::kSqrtSoftplus;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.5;
  int64_t max_position_embeddings = 1048576;
  double rope_theta = 10000.0;
  double compress_rope_theta = 160000.0;
  std::vector<AttentionType> layer_types;
  int64_t compress_rate_csa = 4;    // compress_rates["compressed_sparse_attention"]
  int64_t compress_rate_hca = 128;  // compress_rates["heavily_compressed_attention"]
  int64_t hc_mult = 4;
  int64_t hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;
  std::vector<MlpType> mlp_layer_types;
  double swiglu_limit = 10.0;
  int64_t sliding_window = 128;
  int64_t o_groups = 8;
  int64_t o_lora_rank = 1024;
  int64_t index_n_heads = 64;
  int64_t index_head_dim = 128;
  int64_t index_topk = 512;
  int64_t num_nextn_predict_layers = 1;
  double rms_norm_eps = 1e-6;
  int64_t bos_token_id = 0;
  std::vector<int64_t> eos_token_ids = {1};
  bool tie_word_embeddings = false;
  double partial_rotary_factor = 64.0 / 512.0;
  int64_t qk_rope_head_dim = 64;  // int(head_dim * partial_rotary_factor)
  RopeParameters rope_main, rope_compress;
  std::string torch_dtype = "bfloat16";  // "dtype"/"torch_dtype" of config.json (storage hint only)
  // config.json `quantization_config` with quant_method "fp8" (the released checkpoints: e4m3 weights,
  // 128×128 block scales): the layout --load-format dummy gives the projections the release stores FP8.
  bool fp8_block_weights = false;
  // config.json `expert_dtype` "fp4" (the released V4 checkpoints: MXFP4 routed experts): the layout
  // --load-format dummy gives the routed experts.
  bool fp4_routed_experts = false;
  Numerics numerics = Numerics::kHf;      // a run option, not part of config.json
  // kHf only, a run option: the inputs of the projections a checkpoint stores FP8 are quantized per row and
  // 128 columns (e4m3, UE8M0 scales) as DeepSeek's FP8 linear does — what the GPU backend computes with its
  // FP8 weights (CudaModelOptions::fp8_weights), so the CPU is its twin: kFromBf16 quantizes their bf16
  // rounding (the GPU's bf16 operand), kFromFp32 the fp32 value (its fp32 mode). The rest stays exact fp32.
  Fp8Activations fp8_activations = Fp8Activations::kOff;
  // kHf, a run option (--kv-cache-dtype fp8): the main K=V entries (the raw window and the compressed entries)
  // hold DeepSeek's FP8 entry (cache/kv_entry_format.h: 448 e4m3 channels with a UE8M0 scale per 64, 64 bf16
  // rope channels; 584 bytes instead of bf16's 1024) and the lightning-indexer keys the 132-byte FP8 key
  // (cache/index_key_format.h: 128 e4m3 and one power-of-two fp32 scale, instead of 256 bytes). The GPU backend
  // stores them so (bf16 mode, V4's shapes); the CPU keeps fp32 entries holding the same values (each entry
  // rounded to bf16, then quantized and dequantized), so it is that mode's twin. kDeepSeek simulates FP8 main
  // entries and FP4 index keys always (its own recipe), whatever this says.
  bool fp8_kv_cache = false;

  // Parses an HF config.json object. Throws dsv4::Error naming the field and value on any problem.
  static ModelConfig from_json(const nlohmann::json& json);
  static ModelConfig from_file(const std::string& path);
  // Built-in shapes: "v4-flash", "v4-pro", "tiny" (the embedded default model).
  static ModelConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();

  // The config.json that transformers 5.17 `save_pretrained` writes for this config (nested rope_parameters,
  // explicit layer_types / mlp_layer_types / compress_rates).
  nlohmann::json to_json() const;

  // Checks every field and their consistency; throws dsv4::Error("<field> = <value>: <why>").
  void validate() const;

  int64_t compress_rate(int64_t layer) const;  // 0 for SWA layers
  const RopeParameters& rope_for(RopeKind kind) const { return kind == RopeKind::kMain ? rope_main : rope_compress; }
  RopeKind rope_kind(int64_t layer) const {
    return layer_types[layer] == AttentionType::kSlidingWindow ? RopeKind::kMain : RopeKind::kCompress;
  }
  // Channels rotated by a rope type: int(head_dim * partial_rotary_factor) as HF computes it.
  int64_t rope_dim(RopeKind kind) const;
  // Inverse frequencies of a rope type (one per rotated pair), fp32 as torch computes them, YaRN applied.
  std::vector<float> inv_freq(RopeKind kind) const;
};

}  // namespace dsv4
