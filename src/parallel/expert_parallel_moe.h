// One MoE sublayer's routed experts, expert-parallel over the ranks of a Communicator (docs/parallel.md): every
// rank calls it with its own tokens (data-parallel attention: possibly none) and the router's choices for them,
// and holds only its partition's experts. The steps are expert_dispatch.h's: plan and pack the dispatch, exchange
// the counts, all-to-all the rows with their routes and weights, run each local expert over the rows that chose
// it, all-to-all the summed rows back, combine in rank order. The shared expert is replicated and not here.
//
// The result equals the single-rank MoE to fp32 summation order (expert order within a rank, then rank order),
// and is fixed for a given partition, so repeats are bitwise.
#pragma once
#include <cstdint>
#include <functional>
#include <span>

#include "parallel/communicator.h"
#include "parallel/expert_dispatch.h"

namespace dsv4::parallel {

// Local expert `local_expert` (global id partition.first_expert(rank) + local_expert) over `n` rows [n, hidden]
// with their routing weights [n]: adds weight_i · expert(row_i) into out [n, hidden] (which starts at zero). The
// caller decides where the weight enters (after w2 in transformers' numerics, before w2 in DeepSeek's).
using LocalExpertFn =
    std::function<void(int64_t local_expert, const float* rows, int64_t n, const float* weights, float* out)>;

// x [tokens, hidden]; chosen / weights [tokens, top_k] (distinct experts per token); out [tokens, hidden] gets
// the routed experts' sum added. Throws dsv4::Error (plan_dispatch's) for a choice the router cannot make.
void expert_parallel_moe(Communicator& comm, const ExpertPartition& partition, int64_t hidden, int64_t top_k,
                         const float* x, int64_t tokens, std::span<const int32_t> chosen,
                         std::span<const float> weights, const LocalExpertFn& run_expert, float* out);

}  // namespace dsv4::parallel
