// The CPU forward against HF transformers 5.17 goldens (tools/reference/make_goldens.py): relative L2 of all
// logits ≤ 1e-4, one-shot and chunked through the sequence state.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/npy.h"
#include "test_models.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> golden_dirs() {
  std::vector<fs::path> dirs;
  // DSV4_GOLDENS points the same test at another set (e.g. freshly made, held-back goldens).
  const char* override_root = std::getenv("DSV4_GOLDENS");
  const fs::path root = override_root ? fs::path(override_root) : fs::path(DSV4_FIXTURES) / "goldens";
  if (fs::is_directory(root))
    for (const auto& entry : fs::directory_iterator(root))
      if (fs::is_regular_file(entry.path() / "golden.json")) dirs.push_back(entry.path());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

class HfGolden : public ::testing::TestWithParam<fs::path> {};

TEST_P(HfGolden, LogitsMatchOneShotAndChunked) {
  const fs::path dir = GetParam();
  std::ifstream in(dir / "golden.json");
  const auto golden = nlohmann::json::parse(in);
  const std::vector<int32_t> ids = golden["ids"].get<std::vector<int32_t>>();
  const std::vector<int64_t> chunks = golden["chunks"].get<std::vector<int64_t>>();
  const ModelConfig config = ModelConfig::from_file((dir / "config.json").string());
  DeepseekV4Model model(config, ModelWeights::load(config, dir.string()));
  const int64_t V = config.vocab_size, T = static_cast<int64_t>(ids.size());

  for (const bool chunked : {false, true}) {
    const NpyArray expected = read_npy((dir / (chunked ? "logits_chunked.npy" : "logits.npy")).string());
    ASSERT_EQ(expected.shape, (std::vector<int64_t>{T, V}));
    auto state = model.new_sequence_state();
    std::vector<float> logits;
    int64_t offset = 0;
    for (const int64_t length : chunked ? chunks : std::vector<int64_t>{T}) {
      const SequenceChunk chunk{state.get(), std::span<const int32_t>(ids).subspan(offset, length)};
      const Tensor step = model.forward(std::span(&chunk, 1), LogitsMode::kAllPositions);
      logits.insert(logits.end(), step.data.begin(), step.data.end());
      offset += length;
    }
    const double error = testing::relative_l2(logits.data(), expected.data.data(), expected.data.size());
    RecordProperty(chunked ? "relative_l2_chunked" : "relative_l2", std::to_string(error));
    std::printf("%s %s: relative L2 %.3e\n", dir.filename().c_str(), chunked ? "chunked" : "one-shot", error);
    EXPECT_LE(error, 1e-4) << dir.filename() << (chunked ? " chunked" : " one-shot");
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfGolden, ::testing::ValuesIn(golden_dirs()),
                         [](const ::testing::TestParamInfo<fs::path>& info) { return info.param.filename().string(); });

TEST(HfGoldenFixtures, ArePresent) { EXPECT_GE(golden_dirs().size(), 3u) << "run tools/reference/make_goldens.py"; }

}  // namespace
}  // namespace dsv4
