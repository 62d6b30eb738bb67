#include "parallel/expert_dispatch.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"

namespace dsv4::parallel {

namespace {
std::string n(int64_t value) { return std::to_string(value); }
}  // namespace

ExpertPartition::ExpertPartition(int64_t num_experts, int ep_size) : num_experts_(num_experts), ep_size_(ep_size) {
  DSV4_CHECK(ep_size >= 1 && ep_size <= num_experts,
             "expert parallel size " + n(ep_size) + " must be between 1 and the " + n(num_experts) +
                 " routed experts");
  base_ = num_experts / ep_size;
  larger_ = num_experts % ep_size;
}

int64_t ExpertPartition::first_expert(int rank) const {
  DSV4_CHECK(rank >= 0 && rank < ep_size_, "expert parallel rank " + n(rank) + " of " + n(ep_size_));
  return rank * base_ + std::min<int64_t>(rank, larger_);
}

int64_t ExpertPartition::num_local(int rank) const {
  DSV4_CHECK(rank >= 0 && rank < ep_size_, "expert parallel rank " + n(rank) + " of " + n(ep_size_));
  return base_ + (rank < larger_ ? 1 : 0);
}

int ExpertPartition::owner(int64_t expert) const {
  DSV4_CHECK(expert >= 0 && expert < num_experts_,
             "expert " + n(expert) + " is outside the " + n(num_experts_) + " routed experts");
  // The first larger_ ranks hold base_ + 1 experts each, the rest base_.
  const int64_t in_larger = larger_ * (base_ + 1);
  if (expert < in_larger) return static_cast<int>(expert / (base_ + 1));
  return static_cast<int>(larger_ + (expert - in_larger) / base_);
}

DispatchPlan plan_dispatch(std::span<const int32_t> chosen, std::span<const float> weights, int64_t tokens,
                           int64_t top_k, const ExpertPartition& partition) {
  DSV4_CHECK(tokens >= 0 && top_k >= 1, "dispatch of " + n(tokens) + " tokens with top_k " + n(top_k));
  DSV4_CHECK(static_cast<int64_t>(chosen.size()) == tokens * top_k &&
                 static_cast<int64_t>(weights.size()) == tokens * top_k,
             "dispatch: chosen and weights must hold tokens x top_k = " + n(tokens * top_k) + " entries");
  const int ranks = partition.ep_size();
  DispatchPlan plan;
  plan.top_k = top_k;
  plan.send_counts.assign(static_cast<size_t>(ranks), 0);
  // Pass 1: the destination ranks of every token (a token counts once per rank), validating the choices.
  std::vector<int> owner(static_cast<size_t>(tokens * top_k));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t expert = chosen[static_cast<size_t>(t * top_k + k)];
      for (int64_t j = 0; j < k; ++j)
        DSV4_CHECK(chosen[static_cast<size_t>(t * top_k + j)] != expert,
                   "dispatch: token " + n(t) + " chose expert " + n(expert) + " twice");
      owner[static_cast<size_t>(t * top_k + k)] = partition.owner(expert);
    }
  }
  std::vector<char> seen(static_cast<size_t>(ranks));
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t k = 0; k < top_k; ++k) {
      const int rank = owner[static_cast<size_t>(t * top_k + k)];
      if (!seen[static_cast<size_t>(rank)]) ++plan.send_counts[static_cast<size_t>(rank)];
      seen[static_cast<size_t>(rank)] = 1;
    }
  }
  plan.send_offsets.assign(static_cast<size_t>(ranks) + 1, 0);
  for (int r = 0; r < ranks; ++r)
    plan.send_offsets[static_cast<size_t>(r) + 1] = plan.send_offsets[static_cast<size_t>(r)] +
                                                    plan.send_counts[static_cast<size_t>(r)];
  const int64_t rows = plan.send_offsets.back();
  plan.row_token.assign(static_cast<size_t>(rows), -1);
  plan.row_local_expert.assign(static_cast<size_t>(rows * top_k), -1);
  plan.row_weight.assign(static_cast<size_t>(rows * top_k), 0.0f);
  // Pass 2: place each (token, rank) row; its routes in the token's top-k order. Tokens ascend, so within a
  // rank the rows do too.
  std::vector<int64_t> next(plan.send_offsets.begin(), plan.send_offsets.end() - 1);
  std::vector<int64_t> row_of_rank(static_cast<size_t>(ranks));
  std::vector<int64_t> filled(static_cast<size_t>(ranks));
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(row_of_rank.begin(), row_of_rank.end(), -1);
    for (int64_t k = 0; k < top_k; ++k) {
      const auto rank = static_cast<size_t>(owner[static_cast<size_t>(t * top_k + k)]);
      if (row_of_rank[rank] < 0) {
        row_of_rank[rank] = next[rank]++;
        filled[rank] = 0;
        plan.row_token[static_cast<size_t>(row_of_rank[rank])] = t;
      }
      const auto slot = static_cast<size_t>(row_of_rank[rank] * top_k + filled[rank]++);
      const int32_t expert = chosen[static_cast<size_t>(t * top_k + k)];
      plan.row_local_expert[slot] =
          static_cast<int32_t>(expert - partition.first_expert(static_cast<int>(rank)));
      plan.row_weight[slot] = weights[static_cast<size_t>(t * top_k + k)];
    }
  }
  return plan;
}

void pack_dispatch_rows(const DispatchPlan& plan, const float* x, int64_t hidden, float* send_rows) {
  for (int64_t row = 0; row < plan.num_rows(); ++row)
    std::memcpy(send_rows + row * hidden, x + plan.row_token[static_cast<size_t>(row)] * hidden,
                static_cast<size_t>(hidden) * sizeof(float));
}

ExpertWork plan_expert_work(std::span<const int32_t> routes, std::span<const float> weights, int64_t received_rows,
                            int64_t top_k, int64_t num_local) {
  DSV4_CHECK(static_cast<int64_t>(routes.size()) == received_rows * top_k &&
                 static_cast<int64_t>(weights.size()) == received_rows * top_k,
             "expert work: routes and weights must hold rows x top_k = " + n(received_rows * top_k) + " entries");
  ExpertWork work;
  work.expert_offsets.assign(static_cast<size_t>(num_local) + 1, 0);
  for (const int32_t expert : routes) {
    if (expert < 0) continue;  // padding
    DSV4_CHECK(expert < num_local, "expert work: a received row names local expert " + n(expert) + " of " +
                                       n(num_local) + " (a corrupt transfer)");
    ++work.expert_offsets[static_cast<size_t>(expert) + 1];
  }
  for (int64_t e = 0; e < num_local; ++e)
    work.expert_offsets[static_cast<size_t>(e) + 1] += work.expert_offsets[static_cast<size_t>(e)];
  const int64_t entries = work.expert_offsets.back();
  work.row.resize(static_cast<size_t>(entries));
  work.weight.resize(static_cast<size_t>(entries));
  std::vector<int64_t> next(work.expert_offsets.begin(), work.expert_offsets.end() - 1);
  for (int64_t row = 0; row < received_rows; ++row) {  // rows ascend, so every expert's list does too
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t expert = routes[static_cast<size_t>(row * top_k + k)];
      if (expert < 0) continue;
      const auto at = static_cast<size_t>(next[static_cast<size_t>(expert)]++);
      work.row[at] = row;
      work.weight[at] = weights[static_cast<size_t>(row * top_k + k)];
    }
  }
  return work;
}

void combine_returned(const DispatchPlan& plan, const float* returned_rows, int64_t hidden, float* out) {
  for (int64_t row = 0; row < plan.num_rows(); ++row) {
    float* destination = out + plan.row_token[static_cast<size_t>(row)] * hidden;
    const float* source = returned_rows + row * hidden;
    for (int64_t j = 0; j < hidden; ++j) destination[j] += source[j];
  }
}

}  // namespace dsv4::parallel
