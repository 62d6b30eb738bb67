// The model and tokenizer every text-serving subcommand loads (generate, serve, bench).
#pragma once
#include <cstdint>
#include <string>

#include "model/deepseek_v4.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {

// The embedded default model (model_dir empty): the tiny preset with seed-0 random weights, built in memory.
inline constexpr uint64_t kDefaultModelSeed = 0;

// A HF model directory (config.json + safetensors), or the embedded default when `model_dir` is empty.
// `numerics`: "hf" (default) or "deepseek" (docs/numerics.md); anything else throws dsv4::Error.
DeepseekV4Model load_model(const std::string& model_dir, const std::string& numerics = "hf");

// The tokenizer for text in/out: `explicit_path`, else the model directory's tokenizer.json, else the DeepSeek
// tokenizer that scripts/setup.sh installs next to this checkout. Throws dsv4::Error when none is found.
Tokenizer load_tokenizer(const std::string& explicit_path, const std::string& model_dir);

}  // namespace dsv4::cli
