#include "model/model_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;

// Far above any real V4 depth (V4-Pro has 61 layers); also bounds the default per-layer lists from_json builds.
constexpr int64_t kMaxLayers = int64_t{1} << 16;

const char* scoring_func_name(ScoringFunc func) {
  switch (func) {
    case ScoringFunc::kSqrtSoftplus: return "sqrtsoftplus";
    case ScoringFunc::kSoftmax: return "softmax";
    case ScoringFunc::kSigmoid: return "sigmoid";
  }
  return "?";
}

std::string show(const json& value) { return value.dump(); }

// Reads an optional field with a type check; `json null` counts as absent (HF writes "pad_token_id": null).
template <typename T>
void read_field(const json& config, const char* name, T& out) {
  const auto it = config.find(name);
  if (it == config.end() || it->is_null()) return;
  try {
    if constexpr (std::is_same_v<T, bool>) {
      if (!it->is_boolean()) throw Error("");
      out = it->get<bool>();
    } else if constexpr (std::is_integral_v<T>) {
      if (!it->is_number_integer()) {
        // 4.0 is accepted as 4; 4.5 is not.
        const double value = it->is_number_float() ? it->get<double>() : 0.5;
        if (std::floor(value) != value || std::fabs(value) > 0x1p53) throw Error("");
        out = static_cast<T>(it->get<double>());
      } else {
        out = it->get<T>();
      }
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!it->is_number()) throw Error("");
      out = it->get<T>();
    } else {
      if (!it->is_string()) throw Error("");
      out = it->get<T>();
    }
  } catch (const std::exception&) {
    throw Error(std::string("config field '") + name + "' = " + show(*it) + ": wrong type");
  }
}

AttentionType parse_attention_type(const std::string& name, size_t layer) {
  if (name == "sliding_attention") return AttentionType::kSlidingWindow;
  if (name == "compressed_sparse_attention") return AttentionType::kCompressedSparse;
  if (name == "heavily_compressed_attention") return AttentionType::kHeavilyCompressed;
  throw Error("config field 'layer_types[" + std::to_string(layer) + "]' = \"" + name +
              "\": must be sliding_attention, compressed_sparse_attention or heavily_compressed_attention");
}

MlpType parse_mlp_type(const std::string& name, size_t layer) {
  if (name == "hash_moe") return MlpType::kHashMoe;
  if (name == "moe") return MlpType::kMoe;
  throw Error("config field 'mlp_layer_types[" + std::to_string(layer) + "]' = \"" + name +
              "\": must be hash_moe or moe");
}

// One rope sub-dict (rope_parameters["main"|"compress"], or the flat legacy rope_scaling dict).
RopeParameters parse_rope(const json& dict, const std::string& where, double default_theta,
                          double default_partial_rotary_factor, int64_t max_position_embeddings) {
  RopeParameters rope;
  rope.rope_theta = default_theta;
  rope.partial_rotary_factor = default_partial_rotary_factor;
  std::string type = "default";
  if (dict.contains("type") && dict["type"].is_string()) type = dict["type"].get<std::string>();
  if (dict.contains("rope_type") && dict["rope_type"].is_string()) type = dict["rope_type"].get<std::string>();
  if (type != "default" && type != "yarn")
    throw Error("config field '" + where + ".rope_type' = \"" + type + "\": only default and yarn are supported");
  rope.rope_type = type;
  auto number = [&](const char* key, double& out) {
    if (!dict.contains(key) || dict[key].is_null()) return false;
    if (!dict[key].is_number())
      throw Error("config field '" + where + "." + key + "' = " + show(dict[key]) + ": must be a number");
    out = dict[key].get<double>();
    return true;
  };
  number("rope_theta", rope.rope_theta);
  number("partial_rotary_factor", rope.partial_rotary_factor);
  if (!(rope.partial_rotary_factor >= 0 && rope.partial_rotary_factor <= 1))
    throw Error("config field '" + where + ".partial_rotary_factor' = " + std::to_string(rope.partial_rotary_factor) +
                ": must be in [0, 1]");
  if (type == "yarn") {
    double original = static_cast<double>(max_position_embeddings);  // HF standardize_rope_params default
    number("original_max_position_embeddings", original);
    if (!(original >= 1 && original <= 0x1p53))
      throw Error("config field '" + where + ".original_max_position_embeddings' = " + std::to_string(original) +
                  ": must be a positive integer");
    rope.original_max_position_embeddings = static_cast<int64_t>(original);
    // factor None -> max_position_embeddings / original (transformers `_compute_yarn_parameters`).
    if (!number("factor", rope.factor)) rope.factor = static_cast<double>(max_position_embeddings) / original;
    double beta = 0;
    // `beta_fast or 32`: a zero also falls back to the default, as in Python.
    rope.beta_fast = number("beta_fast", beta) && beta != 0 ? beta : 32.0;
    rope.beta_slow = number("beta_slow", beta) && beta != 0 ? beta : 1.0;
    double attention_factor = 0;
    if (number("attention_factor", attention_factor)) {
      rope.attention_factor = attention_factor;
    } else {
      auto get_mscale = [](double scale, double mscale) {
        return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
      };
      double mscale = 0, mscale_all_dim = 0;
      number("mscale", mscale);
      number("mscale_all_dim", mscale_all_dim);
      rope.attention_factor = (mscale != 0 && mscale_all_dim != 0)
                                  ? get_mscale(rope.factor, mscale) / get_mscale(rope.factor, mscale_all_dim)
                                  : get_mscale(rope.factor, 1.0);
    }
  }
  return rope;
}

json rope_to_json(const RopeParameters& rope) {
  json out = {{"rope_type", rope.rope_type},
              {"rope_theta", rope.rope_theta},
              {"partial_rotary_factor", rope.partial_rotary_factor}};
  if (rope.rope_type == "yarn") {
    out["factor"] = rope.factor;
    out["original_max_position_embeddings"] = rope.original_max_position_embeddings;
    out["beta_fast"] = rope.beta_fast;
    out["beta_slow"] = rope.beta_slow;
    out["attention_factor"] = rope.attention_factor;
  }
  return out;
}

void require(bool ok, const std::string& field, const std::string& value, const std::string& why) {
  if (!ok) throw Error("config field '" + field + "' = " + value + ": " + why);
}

}  // namespace

const char* attention_type_name(AttentionType type) {
  switch (type) {
    case AttentionType::kSlidingWindow: return "sliding_attention";
    case AttentionType::kCompressedSparse: return "compressed_sparse_attention";
    case AttentionType::kHeavilyCompressed: return "heavily_compressed_attention";
  }
  return "?";
}

const char* mlp_type_name(MlpType type) {
  switch (type) {
    case MlpType::kHashMoe: return "hash_moe";
    case MlpType::kMoe: return "moe";
  }
  return "?";
}

ModelConfig ModelConfig::from_json(const json& config) {
  if (!config.is_object()) throw Error("config.json: top level must be a JSON object");
  if (config.contains("model_type")) {
    const auto& type = config["model_type"];
    require(type.is_string() && type.get<std::string>() == "deepseek_v4", "model_type", show(type),
            "must be \"deepseek_v4\"");
  }
  ModelConfig c;
  read_field(config, "vocab_size", c.vocab_size);
  read_field(config, "hidden_size", c.hidden_size);
  read_field(config, "moe_intermediate_size", c.moe_intermediate_size);
  read_field(config, "num_hidden_layers", c.num_hidden_layers);
  read_field(config, "num_attention_heads", c.num_attention_heads);
  read_field(config, "num_key_value_heads", c.num_key_value_heads);
  read_field(config, "head_dim", c.head_dim);
  read_field(config, "q_lora_rank", c.q_lora_rank);
  read_field(config, "num_experts_per_tok", c.num_experts_per_tok);
  read_field(config, "n_routed_experts", c.n_routed_experts);
  read_field(config, "n_shared_experts", c.n_shared_experts);
  std::string scoring = "sqrtsoftplus";
  read_field(config, "scoring_func", scoring);
  if (scoring == "sqrtsoftplus") c.scoring_func = ScoringFunc::kSqrtSoftplus;
  else if (scoring == "softmax") c.scoring_func = ScoringFunc::kSoftmax;
  else if (scoring == "sigmoid") c.scoring_func = ScoringFunc::kSigmoid;
  else require(false, "scoring_func", "\"" + scoring + "\"", "must be sqrtsoftplus, softmax or sigmoid");
  read_field(config, "norm_topk_prob", c.norm_topk_prob);
  read_field(config, "routed_scaling_factor", c.routed_scaling_factor);
  read_field(config, "max_position_embeddings", c.max_position_embeddings);
  read_field(config, "rope_theta", c.rope_theta);
  read_field(config, "compress_rope_theta", c.compress_rope_theta);
  read_field(config, "hc_mult", c.hc_mult);
  read_field(config, "hc_sinkhorn_iters", c.hc_sinkhorn_iters);
  read_field(config, "hc_eps", c.hc_eps);
  read_field(config, "swiglu_limit", c.swiglu_limit);
  read_field(config, "sliding_window", c.sliding_window);
  read_field(config, "o_groups", c.o_groups);
  read_field(config, "o_lora_rank", c.o_lora_rank);
  read_field(config, "index_n_heads", c.index_n_heads);
  read_field(config, "index_head_dim", c.index_head_dim);
  read_field(config, "index_topk", c.index_topk);
  read_field(config, "num_nextn_predict_layers", c.num_nextn_predict_layers);
  read_field(config, "rms_norm_eps", c.rms_norm_eps);
  read_field(config, "bos_token_id", c.bos_token_id);
  read_field(config, "tie_word_embeddings", c.tie_word_embeddings);
  if (config.contains("eos_token_id") && !config["eos_token_id"].is_null()) {
    const auto& eos = config["eos_token_id"];
    c.eos_token_ids.clear();
    if (eos.is_number_integer()) {
      c.eos_token_ids.push_back(eos.get<int64_t>());
    } else if (eos.is_array()) {
      for (const auto& id : eos) {
        require(id.is_number_integer(), "eos_token_id", show(eos), "must be an integer or a list of integers");
        c.eos_token_ids.push_back(id.get<int64_t>());
      }
    } else {
      require(false, "eos_token_id", show(eos), "must be an integer or a list of integers");
    }
  }
  if (config.contains("dtype") && config["dtype"].is_string()) c.torch_dtype = config["dtype"];
  else if (config.contains("torch_dtype") && config["torch_dtype"].is_string()) c.torch_dtype = config["torch_dtype"];
  if (config.contains("quantization_config") && config["quantization_config"].is_object()) {
    const nlohmann::json& q = config["quantization_config"];
    c.fp8_block_weights = q.value("quant_method", std::string()) == "fp8";
  }
  if (config.contains("expert_dtype") && config["expert_dtype"].is_string())
    c.fp4_routed_experts = config["expert_dtype"] == "fp4";
  const int64_t n = c.num_hidden_layers;
  require(n > 0, "num_hidden_layers", std::to_string(n), "must be positive");
  // Checked before the per-layer lists below are built from it (validate() repeats it with the other bounds):
  // a config claiming 10^12 layers must be an error, not a 10^12-entry allocation (found by config_fuzz).
  require(n <= kMaxLayers, "num_hidden_layers", std::to_string(n),
          "is implausibly large (limit " + std::to_string(kMaxLayers) + ")");
  if (c.fp4_routed_experts)  // MXFP4 scales cover 32 inputs
    require(c.hidden_size % 32 == 0 && c.moe_intermediate_size % 32 == 0, "expert_dtype", "\"fp4\"",
            "needs hidden_size and moe_intermediate_size multiples of 32 (one MXFP4 scale per 32 inputs)");

  // compress_rates: the dict field, then the legacy scalars compress_rate_csa / compress_rate_hca override it.
  if (config.contains("compress_rates") && !config["compress_rates"].is_null()) {
    const auto& rates = config["compress_rates"];
    require(rates.is_object(), "compress_rates", show(rates), "must be an object");
    for (const auto& [key, value] : rates.items()) {
      require(value.is_number_integer(), "compress_rates." + key, show(value), "must be an integer");
      if (key == "compressed_sparse_attention") c.compress_rate_csa = value.get<int64_t>();
      else if (key == "heavily_compressed_attention") c.compress_rate_hca = value.get<int64_t>();
      else require(false, "compress_rates", show(rates), "unknown key '" + key + "'");
    }
  }
  read_field(config, "compress_rate_csa", c.compress_rate_csa);
  read_field(config, "compress_rate_hca", c.compress_rate_hca);

  // layer_types: explicit > legacy per-layer compress_ratios (0/4/128) > the V4-Pro default layout.
  if (config.contains("layer_types") && !config["layer_types"].is_null()) {
    const auto& types = config["layer_types"];
    require(types.is_array(), "layer_types", show(types), "must be a list");
    for (size_t i = 0; i < types.size(); ++i) {
      require(types[i].is_string(), "layer_types[" + std::to_string(i) + "]", show(types[i]), "must be a string");
      c.layer_types.push_back(parse_attention_type(types[i].get<std::string>(), i));
    }
  } else if (config.contains("compress_ratios") && !config["compress_ratios"].is_null()) {
    const auto& ratios = config["compress_ratios"];
    require(ratios.is_array(), "compress_ratios", show(ratios), "must be a list");
    for (size_t i = 0; i < ratios.size(); ++i) {
      const auto& r = ratios[i];
      const std::string field = "compress_ratios[" + std::to_string(i) + "]";
      require(r.is_number_integer(), field, show(r), "must be an integer");
      const int64_t ratio = r.get<int64_t>();
      // HF maps exactly 0/4/128 to the three layer types (the rate itself comes from compress_rates).
      if (ratio == 0) c.layer_types.push_back(AttentionType::kSlidingWindow);
      else if (ratio == 4) c.layer_types.push_back(AttentionType::kCompressedSparse);
      else if (ratio == 128) c.layer_types.push_back(AttentionType::kHeavilyCompressed);
      else require(false, field, show(r), "must be 0, 4 or 128");
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      if (i < 2) c.layer_types.push_back(AttentionType::kHeavilyCompressed);
      else c.layer_types.push_back((i - 2) % 2 ? AttentionType::kCompressedSparse : AttentionType::kHeavilyCompressed);
    }
  }
  // Real configs list one ratio more than there are layers (the MTP block); HF keeps the first n.
  require(static_cast<int64_t>(c.layer_types.size()) >= n, "layer_types",
          std::to_string(c.layer_types.size()) + " entries", "needs num_hidden_layers = " + std::to_string(n));
  c.layer_types.resize(static_cast<size_t>(n));

  if (config.contains("mlp_layer_types") && !config["mlp_layer_types"].is_null()) {
    const auto& types = config["mlp_layer_types"];
    require(types.is_array(), "mlp_layer_types", show(types), "must be a list");
    for (size_t i = 0; i < types.size(); ++i) {
      require(types[i].is_string(), "mlp_layer_types[" + std::to_string(i) + "]", show(types[i]), "must be a string");
      c.mlp_layer_types.push_back(parse_mlp_type(types[i].get<std::string>(), i));
    }
    require(static_cast<int64_t>(c.mlp_layer_types.size()) >= n, "mlp_layer_types",
            std::to_string(c.mlp_layer_types.size()) + " entries", "needs num_hidden_layers = " + std::to_string(n));
    c.mlp_layer_types.resize(static_cast<size_t>(n));
  } else {
    int64_t num_hash_layers = 3;
    read_field(config, "num_hash_layers", num_hash_layers);
    require(num_hash_layers >= 0, "num_hash_layers", std::to_string(num_hash_layers), "must be >= 0");
    for (int64_t i = 0; i < n; ++i) c.mlp_layer_types.push_back(i < num_hash_layers ? MlpType::kHashMoe : MlpType::kMoe);
  }

  // partial_rotary_factor: explicit, else legacy qk_rope_head_dim / head_dim, else 64/512.
  bool has_partial = false;
  if (config.contains("partial_rotary_factor") && !config["partial_rotary_factor"].is_null()) {
    read_field(config, "partial_rotary_factor", c.partial_rotary_factor);
    has_partial = true;
  }
  if (!has_partial && config.contains("qk_rope_head_dim") && !config["qk_rope_head_dim"].is_null()) {
    int64_t rope_head_dim = 0;
    read_field(config, "qk_rope_head_dim", rope_head_dim);
    require(c.head_dim > 0, "head_dim", std::to_string(c.head_dim), "must be positive");
    c.partial_rotary_factor = static_cast<double>(rope_head_dim) / static_cast<double>(c.head_dim);
  }
  require(c.partial_rotary_factor >= 0 && c.partial_rotary_factor <= 1, "partial_rotary_factor",
          std::to_string(c.partial_rotary_factor), "must be in [0, 1]");
  require(c.head_dim > 0, "head_dim", std::to_string(c.head_dim), "must be positive");
  c.qk_rope_head_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);

  // Rope parameters: nested {"main","compress"} as 5.17 writes them, or the flat legacy form
  // (rope_scaling / rope_parameters holding the yarn keys) that applies to the compress type only.
  const json* rope = nullptr;
  if (config.contains("rope_scaling") && !config["rope_scaling"].is_null()) rope = &config["rope_scaling"];
  if (config.contains("rope_parameters") && !config["rope_parameters"].is_null()) rope = &config["rope_parameters"];
  const json empty = json::object();
  if (rope) require(rope->is_object(), "rope_parameters", show(*rope), "must be an object");
  if (rope && rope->contains("main") && rope->contains("compress") && (*rope)["main"].is_object() &&
      (*rope)["compress"].is_object()) {
    // Nested sub-dicts carry their own theta and partial factor (HF default for a missing factor: 1.0).
    c.rope_main = parse_rope((*rope)["main"], "rope_parameters.main", c.rope_theta, 1.0, c.max_position_embeddings);
    c.rope_compress = parse_rope((*rope)["compress"], "rope_parameters.compress", c.compress_rope_theta, 1.0,
                                 c.max_position_embeddings);
  } else {
    c.rope_main = RopeParameters{};
    c.rope_main.rope_theta = c.rope_theta;
    c.rope_main.partial_rotary_factor = c.partial_rotary_factor;
    json flat = rope ? *rope : empty;
    flat.erase("main");
    flat.erase("compress");
    flat["rope_theta"] = c.compress_rope_theta;
    flat["partial_rotary_factor"] = c.partial_rotary_factor;
    // DeepseekV4Config.__post_init__: a yarn compress rope gets attention_factor 1.0 unless given (the reference
    // applies no YaRN mscale); only the nested form falls through to _compute_yarn_parameters' default.
    const bool yarn = (flat.contains("rope_type") && flat["rope_type"] == "yarn") ||
                      (!flat.contains("rope_type") && flat.contains("type") && flat["type"] == "yarn");
    if (yarn && !flat.contains("attention_factor")) flat["attention_factor"] = 1.0;
    c.rope_compress = parse_rope(flat, "rope_parameters", c.compress_rope_theta, c.partial_rotary_factor,
                                 c.max_position_embeddings);
  }
  c.validate();
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error("cannot open config '" + path + "'");
  json config;
  try {
    config = json::parse(in);
  } catch (const json::exception& e) {
    throw Error("config '" + path + "' is not valid JSON: " + e.what());
  }
  try {
    return from_json(config);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

int64_t ModelConfig::compress_rate(int64_t layer) const {
  switch (layer_types[static_cast<size_t>(layer)]) {
    case AttentionType::kSlidingWindow: return 0;
    case AttentionType::kCompressedSparse: return compress_rate_csa;
    case AttentionType::kHeavilyCompressed: return compress_rate_hca;
  }
  return 0;
}

int64_t ModelConfig::rope_dim(RopeKind kind) const {
  return static_cast<int64_t>(static_cast<double>(head_dim) * rope_for(kind).partial_rotary_factor);
}

std::vector<float> ModelConfig::inv_freq(RopeKind kind) const {
  const RopeParameters& rope = rope_for(kind);
  const int64_t dim = rope_dim(kind);
  const int64_t pairs = dim / 2;
  // base ** (arange(0, dim, 2).float() / dim) in fp32, then 1 / that, as torch does.
  const float base = static_cast<float>(rope.rope_theta);
  std::vector<float> extrapolation(static_cast<size_t>(pairs)), out(static_cast<size_t>(pairs));
  for (int64_t i = 0; i < pairs; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    extrapolation[i] = 1.0f / std::pow(base, exponent);
  }
  if (rope.rope_type != "yarn") return extrapolation;
  // YaRN (transformers `_compute_yarn_parameters`, truncate=True): blend interpolated and extrapolated
  // frequencies with a linear ramp over the correction range [low, high].
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) *
            std::log(static_cast<double>(rope.original_max_position_embeddings) / (rotations * 2 * M_PI))) /
           (2 * std::log(rope.rope_theta));
  };
  double low = std::floor(correction_dim(rope.beta_fast));
  double high = std::ceil(correction_dim(rope.beta_slow));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const float factor = static_cast<float>(rope.factor);
  for (int64_t i = 0; i < pairs; ++i) {
    const float pos_freq = std::pow(base, static_cast<float>(2 * i) / static_cast<float>(dim));
    const float interpolation = 1.0f / (factor * pos_freq);
    float ramp = (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low);
    ramp = std::clamp(ramp, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    out[i] = interpolation * (1 - extrapolation_factor) + extrapolation[i] * extrapolation_factor;
  }
  return out;
}

void ModelConfig::validate() const {
  auto positive = [](const char* field, int64_t value) {
    require(value > 0, field, std::to_string(value), "must be positive");
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("moe_intermediate_size", moe_intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("head_dim", head_dim);
  positive("q_lora_rank", q_lora_rank);
  positive("num_experts_per_tok", num_experts_per_tok);
  positive("n_routed_experts", n_routed_experts);
  positive("hc_mult", hc_mult);
  positive("hc_sinkhorn_iters", hc_sinkhorn_iters);
  positive("sliding_window", sliding_window);
  positive("o_groups", o_groups);
  positive("o_lora_rank", o_lora_rank);
  positive("max_position_embeddings", max_position_embeddings);
  // Upper bounds far above any real V4 shape keep every tensor size product inside int64.
  auto bounded = [](const char* field, int64_t value, int64_t limit) {
    require(value <= limit, field, std::to_string(value), "is implausibly large (limit " + std::to_string(limit) + ")");
  };
  for (const auto& [field, value] : {std::pair{"vocab_size", vocab_size}, {"hidden_size", hidden_size},
                                     {"moe_intermediate_size", moe_intermediate_size}, {"head_dim", head_dim},
                                     {"q_lora_rank", q_lora_rank}, {"o_lora_rank", o_lora_rank},
                                     {"index_head_dim", index_head_dim}, {"sliding_window", sliding_window}})
    bounded(field, value, int64_t{1} << 24);
  bounded("num_hidden_layers", num_hidden_layers, kMaxLayers);
  for (const auto& [field, value] : {std::pair{"num_attention_heads", num_attention_heads}, {"n_routed_experts", n_routed_experts},
                                     {"index_n_heads", index_n_heads}, {"hc_mult", hc_mult}, {"o_groups", o_groups},
                                     {"hc_sinkhorn_iters", hc_sinkhorn_iters}})
    bounded(field, value, int64_t{1} << 16);
  require(num_key_value_heads == 1, "num_key_value_heads", std::to_string(num_key_value_heads),
          "DeepSeek-V4 has one shared K=V head");
  require(num_experts_per_tok <= n_routed_experts, "num_experts_per_tok", std::to_string(num_experts_per_tok),
          "exceeds n_routed_experts = " + std::to_string(n_routed_experts));
  require(num_attention_heads % o_groups == 0, "o_groups", std::to_string(o_groups),
          "must divide num_attention_heads = " + std::to_string(num_attention_heads));
  require(static_cast<int64_t>(layer_types.size()) == num_hidden_layers, "layer_types",
          std::to_string(layer_types.size()) + " entries", "must equal num_hidden_layers");
  require(static_cast<int64_t>(mlp_layer_types.size()) == num_hidden_layers, "mlp_layer_types",
          std::to_string(mlp_layer_types.size()) + " entries", "must equal num_hidden_layers");
  require(rms_norm_eps > 0, "rms_norm_eps", std::to_string(rms_norm_eps), "must be positive");
  require(hc_eps >= 0, "hc_eps", std::to_string(hc_eps), "must be >= 0");
  require(swiglu_limit > 0, "swiglu_limit", std::to_string(swiglu_limit), "must be positive");
  for (RopeKind kind : {RopeKind::kMain, RopeKind::kCompress}) {
    const char* field = kind == RopeKind::kMain ? "rope_parameters.main" : "rope_parameters.compress";
    const RopeParameters& rope = rope_for(kind);
    const int64_t dim = rope_dim(kind);
    require(dim % 2 == 0 && dim >= 0 && dim <= head_dim, std::string(field) + ".partial_rotary_factor",
            std::to_string(rope.partial_rotary_factor),
            "gives " + std::to_string(dim) + " rotated channels; must be even and <= head_dim");
    require(rope.rope_theta > 0, std::string(field) + ".rope_theta", std::to_string(rope.rope_theta), "must be positive");
    if (rope.rope_type == "yarn") {
      require(rope.factor > 0, std::string(field) + ".factor", std::to_string(rope.factor), "must be positive");
      require(rope.original_max_position_embeddings > 0, std::string(field) + ".original_max_position_embeddings",
              std::to_string(rope.original_max_position_embeddings), "must be positive");
    }
  }
  bool has_csa = false, has_hca = false;
  for (auto type : layer_types) {
    has_csa |= type == AttentionType::kCompressedSparse;
    has_hca |= type == AttentionType::kHeavilyCompressed;
  }
  if (has_csa) {
    positive("compress_rates.compressed_sparse_attention", compress_rate_csa);
    positive("index_n_heads", index_n_heads);
    positive("index_head_dim", index_head_dim);
    positive("index_topk", index_topk);
    require(index_head_dim >= rope_dim(RopeKind::kCompress), "index_head_dim", std::to_string(index_head_dim),
            "must hold the compress rope's " + std::to_string(rope_dim(RopeKind::kCompress)) + " rotated channels");
  }
  if (has_hca) positive("compress_rates.heavily_compressed_attention", compress_rate_hca);
  for (int64_t id : eos_token_ids)
    require(id >= 0 && id < vocab_size, "eos_token_id", std::to_string(id), "outside the vocabulary");
}

json ModelConfig::to_json() const {
  json layer_type_names = json::array(), mlp_type_names = json::array();
  for (auto type : layer_types) layer_type_names.push_back(attention_type_name(type));
  for (auto type : mlp_layer_types) mlp_type_names.push_back(mlp_type_name(type));
  json out = {
      {"architectures", {"DeepseekV4ForCausalLM"}},
      {"model_type", "deepseek_v4"},
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"moe_intermediate_size", moe_intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"q_lora_rank", q_lora_rank},
      {"num_experts_per_tok", num_experts_per_tok},
      {"n_routed_experts", n_routed_experts},
      {"n_shared_experts", n_shared_experts},
      {"scoring_func", scoring_func_name(scoring_func)},
      {"norm_topk_prob", norm_topk_prob},
      {"routed_scaling_factor", routed_scaling_factor},
      {"max_position_embeddings", max_position_embeddings},
      {"rope_theta", rope_theta},
      {"compress_rope_theta", compress_rope_theta},
      {"layer_types", layer_type_names},
      {"compress_rates",
       {{"compressed_sparse_attention", compress_rate_csa}, {"heavily_compressed_attention", compress_rate_hca}}},
      {"hc_mult", hc_mult},
      {"hc_sinkhorn_iters", hc_sinkhorn_iters},
      {"hc_eps", hc_eps},
      {"mlp_layer_types", mlp_type_names},
      {"swiglu_limit", swiglu_limit},
      {"sliding_window", sliding_window},
      {"o_groups", o_groups},
      {"o_lora_rank", o_lora_rank},
      {"index_n_heads", index_n_heads},
      {"index_head_dim", index_head_dim},
      {"index_topk", index_topk},
      {"num_nextn_predict_layers", num_nextn_predict_layers},
      {"hidden_act", "silu"},
      {"rms_norm_eps", rms_norm_eps},
      {"bos_token_id", bos_token_id},
      {"eos_token_id", eos_token_ids.size() == 1 ? json(eos_token_ids[0]) : json(eos_token_ids)},
      {"tie_word_embeddings", tie_word_embeddings},
      {"partial_rotary_factor", partial_rotary_factor},
      {"qk_rope_head_dim", qk_rope_head_dim},
      {"rope_parameters", {{"main", rope_to_json(rope_main)}, {"compress", rope_to_json(rope_compress)}}},
      {"dtype", torch_dtype},
  };
  return out;
}

std::vector<std::string> ModelConfig::preset_names() { return {"v4-flash", "v4-pro", "tiny"}; }

ModelConfig ModelConfig::preset(const std::string& name) {
  json config = {{"model_type", "deepseek_v4"},
                 {"rope_scaling",
                  {{"type", "yarn"}, {"factor", 16}, {"original_max_position_embeddings", 65536},
                   {"beta_fast", 32}, {"beta_slow", 1}}}};
  std::vector<int> ratios;
  if (name == "v4-flash") {
    // inference/config.json of DeepSeek-V4-Flash: 2 SWA layers, then CSA/HCA alternating, + the MTP entry.
    ratios = {0, 0};
    for (int layer = 2; layer < 43; ++layer) ratios.push_back(layer % 2 == 0 ? 4 : 128);
    ratios.push_back(0);
    config.update({{"hidden_size", 4096}, {"num_hidden_layers", 43}, {"num_attention_heads", 64},
                   {"q_lora_rank", 1024}, {"o_groups", 8}, {"n_routed_experts", 256},
                   {"moe_intermediate_size", 2048}, {"routed_scaling_factor", 1.5}, {"index_topk", 512}});
  } else if (name == "v4-pro") {
    // DeepSeek-V4-Pro: 2 HCA layers, then CSA/HCA alternating, + the MTP entry.
    ratios = {128, 128};
    for (int layer = 2; layer < 61; ++layer) ratios.push_back(layer % 2 == 0 ? 4 : 128);
    ratios.push_back(0);
    config.update({{"hidden_size", 7168}, {"num_hidden_layers", 61}, {"num_attention_heads", 128},
                   {"q_lora_rank", 1536}, {"o_groups", 16}, {"n_routed_experts", 384},
                   {"moe_intermediate_size", 3072}, {"routed_scaling_factor", 2.5}, {"index_topk", 1024}});
  } else if (name == "tiny") {
    // The embedded default model: every layer kind, the real vocabulary, small enough for a laptop CPU.
    ratios = {0, 4, 128, 4};
    config.update({{"hidden_size", 256}, {"num_hidden_layers", 4}, {"num_attention_heads", 4},
                   {"head_dim", 128}, {"qk_rope_head_dim", 32}, {"q_lora_rank", 128}, {"o_groups", 2},
                   {"o_lora_rank", 128}, {"n_routed_experts", 8}, {"num_experts_per_tok", 2},
                   {"moe_intermediate_size", 256}, {"num_hash_layers", 1}, {"index_n_heads", 4},
                   {"index_head_dim", 64}, {"index_topk", 64}, {"max_position_embeddings", 65536}});
  } else {
    std::string names;
    for (const auto& preset : preset_names()) names += (names.empty() ? "" : ", ") + preset;
    throw Error("unknown preset '" + name + "' (known: " + names + ")");
  }
  config["compress_ratios"] = ratios;
  return from_json(config);
}

}  // namespace dsv4
