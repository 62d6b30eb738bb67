// CPU forward of the embedded tiny model (preset "tiny", random weights): a prefill of N tokens, and one decode
// step at a given context. Run: build/bench/dsv4_bench_forward
#include <benchmark/benchmark.h>

#include <memory>
#include <cstring>
#include <random>

#include "model/deepseek_v4.h"
#include "model/random_init.h"
#include "ops/cpu/linear.h"

namespace dsv4 {
namespace {

DeepseekV4Model& tiny_model() {
  static DeepseekV4Model model = [] {
    const ModelConfig config = ModelConfig::preset("tiny");
    return DeepseekV4Model(config, random_weights(config, 0));
  }();
  return model;
}

std::vector<int32_t> random_ids(int64_t n) {
  std::mt19937 rng(1);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % tiny_model().config().vocab_size);
  return ids;
}

// Prefill: logits of the last position only (what serving needs).
void BM_TinyPrefill(benchmark::State& state) {
  DeepseekV4Model& model = tiny_model();
  const auto ids = random_ids(state.range(0));
  for (auto _ : state) {
    auto sequence = model.new_sequence_state();
    const SequenceChunk chunk{sequence.get(), ids};
    benchmark::DoNotOptimize(model.forward(std::span(&chunk, 1), LogitsMode::kLastPerSequence));
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.range(0)), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TinyPrefill)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

// One decode token for each of `batch` requests that already hold `context` tokens.
void BM_TinyDecodeStep(benchmark::State& state) {
  DeepseekV4Model& model = tiny_model();
  const int64_t context = state.range(0), batch = state.range(1);
  const auto ids = random_ids(context + 1);
  std::vector<std::unique_ptr<SequenceState>> sequences;
  for (int64_t b = 0; b < batch; ++b) {
    sequences.push_back(model.new_sequence_state());
    const SequenceChunk prefill{sequences.back().get(), std::span<const int32_t>(ids).first(context)};
    model.forward(std::span(&prefill, 1), LogitsMode::kLastPerSequence);
  }
  std::vector<SequenceChunk> step;
  for (auto& sequence : sequences) step.push_back({sequence.get(), std::span<const int32_t>(ids).subspan(context, 1)});
  for (auto _ : state) {
    benchmark::DoNotOptimize(model.forward(step, LogitsMode::kLastPerSequence));
    state.PauseTiming();
    for (auto& sequence : sequences) sequence->set_num_tokens(context);  // re-run the same position
    state.ResumeTiming();
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_TinyDecodeStep)->Args({1024, 1})->Args({1024, 8})->Unit(benchmark::kMillisecond)->UseRealTime();

// Ceilings measured in the same run, for the roofline ratios in docs/PERF.md: host memory bandwidth (a 256 MiB
// copy counts 2 bytes moved per byte) and the fp32 GEMM rate of OpenBLAS at a prefill-like shape.
void BM_MemoryCopyBandwidth(benchmark::State& state) {
  const size_t bytes = size_t{256} << 20;
  std::vector<char> source(bytes, 1), target(bytes, 0);
  for (auto _ : state) {
    std::memcpy(target.data(), source.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * bytes));
}
BENCHMARK(BM_MemoryCopyBandwidth)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Sgemm(benchmark::State& state) {
  const int64_t m = 1024, n = 1024, k = 1024;
  std::vector<float> a(m * k, 0.5f), b(n * k, 0.25f), c(m * n);
  for (auto _ : state) ops::cpu::linear(a.data(), m, k, b.data(), n, c.data());
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * m * n * k, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Sgemm)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace dsv4

BENCHMARK_MAIN();
