// The CUDA model with expert parallelism (DeepseekV4CudaModel::set_expert_parallel, docs/parallel.md): 1 to 4
// ranks on ONE GPU exchanging device memory through the device in-process group (NCCL refuses two ranks on one
// device), one thread, one model and one cache each, every rank serving its own request (its prompt in two chunks,
// then greedy decode steps, all ranks stepping together). Each rank's logits must equal one model's without expert
// parallelism for the same request: fp32 mode, to summation order (the routed sum is taken per rank, then in rank
// order, the shared expert last), with the same greedy tokens; and rows must really cross ranks. Skipped without
// a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../test_models.h"
#include "../../parallel/counting_communicator.h"
#include "cache/hybrid_kv_cache_manager.h"
#include "model/cuda/deepseek_v4_cuda.h"
#include "model/random_init.h"
#include "parallel/communicator.h"
#include "parallel/device_in_process_group.h"

namespace dsv4 {
namespace {

using testing::CountingCommunicator;
using testing::random_ids;
using testing::relative_l2;

int32_t argmax(const std::vector<float>& row) {
  size_t best = 0;
  for (size_t i = 1; i < row.size(); ++i)
    if (row[i] > row[best]) best = i;
  return static_cast<int32_t>(best);
}

// One model with its own cache; with ranks > 1 it holds only rank `rank`'s partition of the routed experts.
struct RankModel {
  RankModel(const ModelConfig& config, const ModelWeights& weights, int ranks = 1, int rank = 0) {
    CudaModelOptions options;
    options.precision = CudaPrecision::kF32;
    options.expert_parallel_size = ranks;
    options.expert_parallel_rank = rank;
    model = std::make_unique<DeepseekV4CudaModel>(config, weights, options);
    PrefixCacheOptions cache_options;
    cache_options.enabled = false;
    manager = std::make_unique<HybridKvCacheManager>(
        CacheLayout::for_model(config, model->kv_storage(), model->index_storage()), int64_t{1} << 28, cache_options);
    model->bind_cache(*manager);
  }
  std::unique_ptr<DeepseekV4CudaModel> model;
  std::unique_ptr<HybridKvCacheManager> manager;
};

// Request `id` on `rank`: its prompt in two chunks, then `decode` greedy tokens; every step's last logits.
std::vector<std::vector<float>> run_request(RankModel& rank, RequestId id, const std::vector<int32_t>& prompt,
                                            int decode) {
  if (rank.manager->admit(id, prompt).value_or(-1) != 0) throw std::runtime_error("admission failed");
  auto state = rank.model->make_state(id);
  std::vector<int32_t> tokens = prompt;
  std::vector<std::vector<float>> logits;
  int64_t done = 0;
  auto step = [&](int64_t length) {
    if (!rank.manager->allocate(id, length)) throw std::runtime_error("no cache blocks");
    const SequenceChunk chunk{state.get(), std::span<const int32_t>(tokens).subspan(static_cast<size_t>(done),
                                                                                     static_cast<size_t>(length))};
    logits.push_back(rank.model->forward(std::span(&chunk, 1), LogitsMode::kLastPerSequence).data);
    done += length;
    rank.manager->commit(id, tokens, done);
  };
  const auto half = static_cast<int64_t>(prompt.size() / 2);
  step(half);
  step(static_cast<int64_t>(prompt.size()) - half);
  for (int i = 0; i < decode; ++i) {
    tokens.push_back(argmax(logits.back()));
    step(1);
  }
  return logits;
}

TEST(CudaExpertParallel, RanksOnOneGpuEqualOneModel) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ModelConfig config = testing::small_config();  // 6 routed experts, top-2, hash and score-routed layers
  config.moe_intermediate_size = 16;             // the CUDA model's grouped GEMMs need multiples of 8
  const ModelWeights weights = random_weights(config, 11);
  const int decode = 5;
  for (const int R : {1, 2, 3, 4}) {
    SCOPED_TRACE(std::to_string(R) + " ranks");
    std::vector<std::vector<int32_t>> prompts;
    for (int r = 0; r < R; ++r)
      prompts.push_back(random_ids(11 + 9 * static_cast<size_t>(r), config.vocab_size, 40 + static_cast<uint32_t>(r)));
    std::vector<std::vector<std::vector<float>>> expected;
    {
      RankModel single(config, weights);
      for (int r = 0; r < R; ++r) expected.push_back(run_request(single, r, prompts[static_cast<size_t>(r)], decode));
    }
    std::vector<cudaStream_t> streams(static_cast<size_t>(R));
    for (cudaStream_t& stream : streams) ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    const std::unique_ptr<parallel::InProcessGroup> group = parallel::make_device_in_process_group(streams);
    std::vector<std::unique_ptr<RankModel>> ranks;
    std::vector<std::unique_ptr<CountingCommunicator>> comms;
    const int64_t full_bytes = RankModel(config, weights).model->weight_bytes();
    for (int r = 0; r < R; ++r) {
      ranks.push_back(std::make_unique<RankModel>(config, weights, R, r));
      comms.push_back(std::make_unique<CountingCommunicator>(group->communicator(r)));
      ranks.back()->model->set_expert_parallel(comms.back().get());
      // Only the rank's partition of the routed experts is on the device.
      if (R > 1) {
        EXPECT_LT(ranks.back()->model->weight_bytes(), full_bytes) << "rank " << r;
      }
    }
    std::vector<std::vector<std::vector<float>>> actual(static_cast<size_t>(R));
    std::vector<std::string> errors(static_cast<size_t>(R));
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        try {
          if (cudaSetDevice(0) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
          actual[static_cast<size_t>(r)] =
              run_request(*ranks[static_cast<size_t>(r)], r, prompts[static_cast<size_t>(r)], decode);
        } catch (const std::exception& error) {
          errors[static_cast<size_t>(r)] = error.what();
          comms[static_cast<size_t>(r)]->abort(error.what());  // release the other ranks
        }
      });
    for (std::thread& thread : threads) thread.join();
    int64_t crossed = 0;
    for (const auto& comm : comms) crossed += comm->bytes_from_others;
    if (R > 1) {
      EXPECT_GT(crossed, 0) << "no row crossed ranks";
    }
    for (int r = 0; r < R; ++r) {
      const auto& e = expected[static_cast<size_t>(r)];
      const auto& a = actual[static_cast<size_t>(r)];
      ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
      // 5 collectives (counts, rows, routes, weights, return) per MoE sublayer and step.
      EXPECT_EQ(comms[static_cast<size_t>(r)]->collectives,
                5 * config.num_hidden_layers * static_cast<int64_t>(e.size()))
          << "rank " << r;
      ASSERT_EQ(a.size(), e.size());
      for (size_t step = 0; step < e.size(); ++step) {
        EXPECT_LE(relative_l2(a[step].data(), e[step].data(), e[step].size()), 1e-5)
            << "rank " << r << ", step " << step;
        EXPECT_EQ(argmax(a[step]), argmax(e[step])) << "rank " << r << ", step " << step;
      }
    }
    ranks.clear();
    for (cudaStream_t stream : streams) cudaStreamDestroy(stream);
  }
}

// A rank with nothing scheduled still takes part: an empty batch (the engine's forward_every_step) runs every MoE
// sublayer's collectives and serves the rows the other rank sends to its experts. Rank 0 serves a request for 10
// steps while rank 1 idles for its first 4 and serves a shorter one after; both equal one model's logits.
TEST(CudaExpertParallel, AnIdleRankServesTheOtherWithAnEmptyBatch) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ModelConfig config = testing::small_config();
  config.moe_intermediate_size = 16;
  const ModelWeights weights = random_weights(config, 14);
  const std::vector<int32_t> prompt0 = random_ids(12, config.vocab_size, 51);
  const std::vector<int32_t> prompt1 = random_ids(5, config.vocab_size, 52);
  const int decode0 = 8, decode1 = 4, idle1 = 4;  // rank 0: 2 + 8 steps; rank 1: 4 idle + 2 + 4
  std::vector<std::vector<float>> expected0, expected1;
  {
    RankModel single(config, weights);
    expected0 = run_request(single, 0, prompt0, decode0);
    expected1 = run_request(single, 1, prompt1, decode1);
  }
  std::vector<cudaStream_t> streams(2);
  for (cudaStream_t& stream : streams) ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const std::unique_ptr<parallel::InProcessGroup> group = parallel::make_device_in_process_group(streams);
  std::vector<std::unique_ptr<RankModel>> ranks;
  std::vector<std::unique_ptr<CountingCommunicator>> comms;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<RankModel>(config, weights, 2, r));
    comms.push_back(std::make_unique<CountingCommunicator>(group->communicator(r)));
    ranks.back()->model->set_expert_parallel(comms.back().get());
  }
  std::vector<std::vector<float>> actual0, actual1;
  std::string error0, error1;
  std::thread rank0([&] {
    try {
      if (cudaSetDevice(0) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
      actual0 = run_request(*ranks[0], 0, prompt0, decode0);
    } catch (const std::exception& error) {
      error0 = error.what();
      comms[0]->abort(error.what());
    }
  });
  std::thread rank1([&] {
    try {
      if (cudaSetDevice(0) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
      for (int i = 0; i < idle1; ++i) {
        const Tensor empty = ranks[1]->model->forward({}, LogitsMode::kLastPerSequence);
        if (empty.numel() != 0) throw std::runtime_error("an empty batch returned logits");
      }
      actual1 = run_request(*ranks[1], 1, prompt1, decode1);
    } catch (const std::exception& error) {
      error1 = error.what();
      comms[1]->abort(error.what());
    }
  });
  rank0.join();
  rank1.join();
  ASSERT_EQ(error0, "");
  ASSERT_EQ(error1, "");
  EXPECT_GT(comms[0]->bytes_from_others + comms[1]->bytes_from_others, 0);
  // Every step of both ranks ran the 5 collectives of every MoE sublayer, the idle ones included.
  EXPECT_EQ(comms[1]->collectives, 5 * config.num_hidden_layers * (idle1 + static_cast<int64_t>(expected1.size())));
  for (const auto& [actual, expected] : {std::pair{&actual0, &expected0}, std::pair{&actual1, &expected1}}) {
    ASSERT_EQ(actual->size(), expected->size());
    for (size_t step = 0; step < expected->size(); ++step) {
      EXPECT_LE(relative_l2((*actual)[step].data(), (*expected)[step].data(), (*expected)[step].size()), 1e-5)
          << "step " << step;
      EXPECT_EQ(argmax((*actual)[step]), argmax((*expected)[step])) << "step " << step;
    }
  }
  ranks.clear();
  for (cudaStream_t stream : streams) cudaStreamDestroy(stream);
}

// A partition-only model refuses a communicator of another size or rank, and refuses to run without one.
TEST(CudaExpertParallel, APartitionRunsOnlyAtItsRank) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ModelConfig config = testing::small_config();
  config.moe_intermediate_size = 16;
  const ModelWeights weights = random_weights(config, 13);
  RankModel rank1(config, weights, 2, 1);
  parallel::InProcessGroup pair(2), triple(3);
  const std::unique_ptr<parallel::Communicator> wrong_rank = pair.communicator(0), wrong_size = triple.communicator(1);
  EXPECT_THROW(rank1.model->set_expert_parallel(wrong_rank.get()), Error);
  EXPECT_THROW(rank1.model->set_expert_parallel(wrong_size.get()), Error);
  EXPECT_THROW(run_request(rank1, 0, random_ids(6, config.vocab_size, 3), 0), Error);  // no communicator set
  CudaModelOptions bad;
  bad.expert_parallel_size = 2;
  bad.expert_parallel_rank = 2;
  EXPECT_THROW(DeepseekV4CudaModel(config, weights, bad), Error);
}

TEST(CudaExpertParallel, RefusesMoreRanksThanExpertsAndNoCommunicator) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ModelConfig config = testing::small_config();
  config.moe_intermediate_size = 16;
  const ModelWeights weights = random_weights(config, 12);
  CudaModelOptions options;
  options.precision = CudaPrecision::kF32;
  DeepseekV4CudaModel model(config, weights, options);
  parallel::InProcessGroup too_many(static_cast<int>(config.n_routed_experts) + 1);
  const std::unique_ptr<parallel::Communicator> comm = too_many.communicator(0);
  EXPECT_THROW(model.set_expert_parallel(comm.get()), Error);
  EXPECT_THROW(model.set_expert_parallel(nullptr), Error);
}

}  // namespace
}  // namespace dsv4
