// random_init's fills run over the thread pool with SplitMix64 jump-ahead; they must give exactly the values of
// the plain sequential loop (every random model, checkpoint and golden depends on them). The reference below is
// that loop, written out independently of src/model/random_init.cpp.
#include "model/random_init.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace dsv4 {
namespace {

uint64_t reference_hash_name(const std::string& name, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a
  for (const unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

struct ReferenceSplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double normal() {
    const double u1 = 1.0 - uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }
};

// One generator per tensor, seeded by its name, drawn element after element.
std::vector<float> sequential_normal(const std::string& name, uint64_t seed, int64_t count, double stddev,
                                     double mean = 0.0) {
  ReferenceSplitMix64 random{reference_hash_name(name, seed)};
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = static_cast<float>(mean + stddev * random.normal());
  return values;
}

std::vector<float> sequential_uniform_plus_half(const std::string& name, uint64_t seed, int64_t count) {
  ReferenceSplitMix64 random{reference_hash_name(name, seed)};
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = static_cast<float>(0.5 + random.uniform());
  return values;
}

const Tensor& find(const std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& name) {
  for (const auto& [tensor_name, tensor] : tensors)
    if (tensor_name == name) return tensor;
  throw std::runtime_error("no tensor " + name);
}

void expect_bitwise_equal(const std::vector<float>& actual, const std::vector<float>& expected, const std::string& name) {
  ASSERT_EQ(actual.size(), expected.size()) << name;
  EXPECT_EQ(std::memcmp(actual.data(), expected.data(), actual.size() * sizeof(float)), 0) << name;
}

// The tiny preset's embedding (33M elements: a thousand parallel chunks), a linear, a norm weight (mean 1) and an
// mHC scale (the uniform draw), for two seeds.
TEST(RandomInit, ParallelFillsEqualTheSequentialLoop) {
  const ModelConfig config = ModelConfig::preset("tiny");
  const double D = static_cast<double>(config.hidden_size);
  for (const uint64_t seed : {uint64_t{0}, uint64_t{12345}}) {
    const auto tensors = random_tensors(config, seed);
    const std::string embed = "model.embed_tokens.weight";
    expect_bitwise_equal(find(tensors, embed).data,
                         sequential_normal(embed, seed, config.vocab_size * config.hidden_size, 1.0), embed);
    const std::string wq_a = "model.layers.1.attn.wq_a.weight";
    expect_bitwise_equal(find(tensors, wq_a).data,
                         sequential_normal(wq_a, seed, config.q_lora_rank * config.hidden_size, 1.0 / std::sqrt(D)),
                         wq_a);
    const std::string norm = "model.norm.weight";
    expect_bitwise_equal(find(tensors, norm).data, sequential_normal(norm, seed, config.hidden_size, 0.1, 1.0), norm);
    const std::string scale = "model.layers.2.hc_ffn_scale";
    expect_bitwise_equal(find(tensors, scale).data, sequential_uniform_plus_half(scale, seed, 3), scale);
  }
}

}  // namespace
}  // namespace dsv4
