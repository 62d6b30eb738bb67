// The expert-parallel plans (parallel/expert_dispatch.h) against brute force, and a whole MoE sublayer run
// expert-parallel over 1-4 simulated ranks against the naive per-token formula
//   out[t] = Σ_k weight[t,k] · W2[e] · swiglu_clamped(W13[e] · x[t]),  e = chosen[t,k].
// The sublayer is parallel/expert_parallel_moe.h on one thread per rank, its all-to-alls through an
// InProcessGroup (parallel/communicator.h), which delivers what the NCCL grouped send/recv does: every source's
// block for a destination, in source-rank order.
#include "parallel/expert_dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "parallel/communicator.h"
#include "parallel/expert_parallel_moe.h"

namespace dsv4::parallel {
namespace {

TEST(ExpertPartition, ContiguousBlocksCoverEveryExpertOnce) {
  for (const int64_t experts : {1, 7, 16, 32, 256}) {
    for (int ranks = 1; ranks <= std::min<int64_t>(experts, 9); ++ranks) {
      const ExpertPartition partition(experts, ranks);
      int64_t next = 0, smallest = experts, largest = 0;
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(partition.first_expert(r), next);
        for (int64_t i = 0; i < partition.num_local(r); ++i) EXPECT_EQ(partition.owner(next + i), r);
        next += partition.num_local(r);
        smallest = std::min(smallest, partition.num_local(r));
        largest = std::max(largest, partition.num_local(r));
      }
      EXPECT_EQ(next, experts);
      EXPECT_LE(largest - smallest, 1);  // balanced
    }
  }
}

TEST(ExpertPartition, RejectsBadSizesAndExperts) {
  EXPECT_THROW(ExpertPartition(8, 0), Error);
  EXPECT_THROW(ExpertPartition(8, 9), Error);
  const ExpertPartition partition(8, 3);
  EXPECT_THROW((void)partition.owner(8), Error);
  EXPECT_THROW((void)partition.owner(-1), Error);
  EXPECT_THROW((void)partition.num_local(3), Error);
}

// Distinct experts per token (as the router gives them) and positive weights.
void draw_routing(std::mt19937& rng, int64_t tokens, int64_t experts, int64_t top_k, std::vector<int32_t>& chosen,
                  std::vector<float>& weights) {
  std::vector<int32_t> ids(static_cast<size_t>(experts));
  std::uniform_real_distribution<float> weight(0.05f, 1.5f);
  chosen.clear();
  weights.clear();
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int64_t k = 0; k < top_k; ++k) {
      chosen.push_back(ids[static_cast<size_t>(k)]);
      weights.push_back(weight(rng));
    }
  }
}

TEST(ExpertDispatch, PlanSendsEveryChoiceOnceToItsOwner) {
  std::mt19937 rng(11);
  for (const int ranks : {1, 2, 3, 4, 8}) {
    const int64_t experts = 16, top_k = 6, tokens = 37;
    const ExpertPartition partition(experts, ranks);
    std::vector<int32_t> chosen;
    std::vector<float> weights;
    draw_routing(rng, tokens, experts, top_k, chosen, weights);
    const DispatchPlan plan = plan_dispatch(chosen, weights, tokens, top_k, partition);
    ASSERT_EQ(plan.send_offsets.size(), static_cast<size_t>(ranks) + 1);
    EXPECT_EQ(plan.send_offsets.back(), plan.num_rows());
    // Brute force: the (token, rank) pairs with at least one chosen expert there, each exactly one row.
    int64_t expected_rows = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int r = 0; r < ranks; ++r) {
        std::vector<std::pair<int32_t, float>> expected;  // (local expert, weight) in top-k order
        for (int64_t k = 0; k < top_k; ++k)
          if (partition.owner(chosen[t * top_k + k]) == r)
            expected.emplace_back(static_cast<int32_t>(chosen[t * top_k + k] - partition.first_expert(r)),
                                  weights[t * top_k + k]);
        int64_t found = 0;
        for (int64_t row = plan.send_offsets[r]; row < plan.send_offsets[r + 1]; ++row) {
          if (plan.row_token[row] != t) continue;
          ++found;
          for (int64_t k = 0; k < top_k; ++k) {
            const size_t slot = static_cast<size_t>(row * top_k + k);
            if (k < static_cast<int64_t>(expected.size())) {
              EXPECT_EQ(plan.row_local_expert[slot], expected[k].first);
              EXPECT_EQ(plan.row_weight[slot], expected[k].second);
            } else {
              EXPECT_EQ(plan.row_local_expert[slot], -1);
              EXPECT_EQ(plan.row_weight[slot], 0.0f);
            }
          }
        }
        EXPECT_EQ(found, expected.empty() ? 0 : 1) << "token " << t << " rank " << r;
        expected_rows += expected.empty() ? 0 : 1;
      }
    }
    EXPECT_EQ(plan.num_rows(), expected_rows);
    for (int r = 0; r < ranks; ++r)  // within a destination, tokens ascend
      EXPECT_TRUE(std::is_sorted(plan.row_token.begin() + plan.send_offsets[r],
                                 plan.row_token.begin() + plan.send_offsets[r + 1]));
  }
}

TEST(ExpertDispatch, RejectsWhatTheRouterCannotProduce) {
  const ExpertPartition partition(8, 2);
  const std::vector<float> weights(4, 1.0f);
  EXPECT_THROW(plan_dispatch(std::vector<int32_t>{1, 1, 2, 3}, weights, 2, 2, partition), Error);  // twice
  EXPECT_THROW(plan_dispatch(std::vector<int32_t>{1, 8, 2, 3}, weights, 2, 2, partition), Error);  // range
  EXPECT_THROW(plan_dispatch(std::vector<int32_t>{1, 2, 3}, weights, 2, 2, partition), Error);     // shape
  EXPECT_THROW(plan_expert_work(std::vector<int32_t>{0, 4}, std::vector<float>{1, 1}, 1, 2, 4), Error);
}

struct Experts {
  int64_t hidden, inter;
  float limit;
  std::vector<std::vector<float>> w13, w2;  // per expert: [2·inter, hidden] and [hidden, inter]

  // weight · W2 · swiglu(W13 · rows) added into out (the rows' own order).
  void run(int64_t expert, const float* rows, int64_t n, const float* row_weight, float* out) const {
    std::vector<float> gate_up(static_cast<size_t>(n * 2 * inter)), activated(static_cast<size_t>(n * inter)),
        result(static_cast<size_t>(n * hidden));
    ops::cpu::linear(rows, n, hidden, w13[expert].data(), 2 * inter, gate_up.data());
    ops::cpu::swiglu_clamped(gate_up.data(), n, inter, limit, activated.data());
    ops::cpu::linear(activated.data(), n, inter, w2[expert].data(), hidden, result.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < hidden; ++j) out[i * hidden + j] += row_weight[i] * result[i * hidden + j];
  }
};

Experts draw_experts(std::mt19937& rng, int64_t experts, int64_t hidden, int64_t inter) {
  Experts e{hidden, inter, 7.0f, {}, {}};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < experts; ++i) {
    std::vector<float> w13(static_cast<size_t>(2 * inter * hidden)), w2(static_cast<size_t>(hidden * inter));
    for (float& v : w13) v = normal(rng) / std::sqrt(static_cast<float>(hidden));
    for (float& v : w2) v = normal(rng) / std::sqrt(static_cast<float>(inter));
    e.w13.push_back(std::move(w13));
    e.w2.push_back(std::move(w2));
  }
  return e;
}

struct RankTokens {
  int64_t tokens = 0;
  std::vector<float> x;  // [tokens, hidden]
  std::vector<int32_t> chosen;
  std::vector<float> weights;
};

// One routed-MoE sublayer, expert-parallel over ranks.size() ranks: parallel/expert_parallel_moe.h on one thread
// per rank, the all-to-alls through an InProcessGroup.
std::vector<std::vector<float>> run_expert_parallel(const std::vector<RankTokens>& ranks, const Experts& experts,
                                                    int64_t num_experts, int64_t top_k) {
  const int R = static_cast<int>(ranks.size());
  const int64_t D = experts.hidden;
  const ExpertPartition partition(num_experts, R);
  InProcessGroup group(R);
  std::vector<std::vector<float>> out(static_cast<size_t>(R));
  std::vector<std::string> errors(static_cast<size_t>(R));
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    out[r].assign(static_cast<size_t>(ranks[r].tokens * D), 0.0f);
    threads.emplace_back([&, r] {
      const std::unique_ptr<Communicator> comm = group.communicator(r);
      const auto run = [&](int64_t local, const float* rows, int64_t n, const float* weights, float* partial) {
        experts.run(partition.first_expert(r) + local, rows, n, weights, partial);
      };
      try {
        expert_parallel_moe(*comm, partition, D, top_k, ranks[r].x.data(), ranks[r].tokens,
                                      ranks[r].chosen, ranks[r].weights, run, out[r].data());
      } catch (const std::exception& error) {
        errors[r] = error.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int r = 0; r < R; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return out;
}

TEST(ExpertDispatch, ExpertParallelMoeEqualsTheNaiveFormula) {
  const int64_t num_experts = 12, top_k = 4, hidden = 48, inter = 24;
  std::mt19937 rng(2026);
  const Experts experts = draw_experts(rng, num_experts, hidden, inter);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int R : {1, 2, 3, 4}) {
    std::vector<RankTokens> ranks(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) {
      ranks[r].tokens = r == 1 ? 0 : 1 + static_cast<int64_t>(rng() % 29);  // rank 1 idle: sends and gets nothing
      ranks[r].x.resize(static_cast<size_t>(ranks[r].tokens * hidden));
      for (float& v : ranks[r].x) v = normal(rng);
      draw_routing(rng, ranks[r].tokens, num_experts, top_k, ranks[r].chosen, ranks[r].weights);
    }
    const auto out = run_expert_parallel(ranks, experts, num_experts, top_k);
    const auto repeat = run_expert_parallel(ranks, experts, num_experts, top_k);
    for (int r = 0; r < R; ++r) {
      // An idle rank's output is empty and its data() may be null, which memcmp may not be given.
      ASSERT_EQ(out[r].size(), repeat[r].size());
      if (!out[r].empty()) {
        EXPECT_EQ(std::memcmp(out[r].data(), repeat[r].data(), out[r].size() * sizeof(float)), 0) << "repeat";
      }
      double error = 0, norm = 0;
      for (int64_t t = 0; t < ranks[r].tokens; ++t) {
        std::vector<float> naive(static_cast<size_t>(hidden), 0.0f);
        for (int64_t k = 0; k < top_k; ++k)
          experts.run(ranks[r].chosen[t * top_k + k], &ranks[r].x[t * hidden], 1, &ranks[r].weights[t * top_k + k],
                      naive.data());
        for (int64_t j = 0; j < hidden; ++j) {
          const double diff = out[r][t * hidden + j] - naive[j];
          error += diff * diff;
          norm += static_cast<double>(naive[j]) * naive[j];
        }
      }
      if (ranks[r].tokens > 0) {
        EXPECT_GT(norm, 0.0);
        EXPECT_LE(std::sqrt(error / norm), 1e-6) << R << " ranks, rank " << r;  // fp32 summation order only
      }
    }
  }
}

}  // namespace
}  // namespace dsv4::parallel
