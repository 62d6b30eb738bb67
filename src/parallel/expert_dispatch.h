// Expert parallelism for the routed experts (issue 9; docs/parallel.md): which rank holds which expert, and the
// index plans of the dispatch and combine all-to-alls around the routed-expert GEMMs.
//
// The deployment this serves is DeepSeek's own: attention data-parallel (each rank runs its own requests'
// tokens, engine/data_parallel_engine.h), the router replicated (every rank routes its own tokens), the routed
// experts split over the ranks. One MoE sublayer on rank s is then
//   1. plan_dispatch: its tokens' top-k choices grouped by the rank that owns each chosen expert; a token goes
//      to a rank once however many of its experts live there (DeepEP's dedup), with up to top_k
//      (local expert, weight) routes beside it;
//   2. all-to-all of the rows, routes and weights (NCCL grouped send/recv; the counts go first);
//   3. plan_expert_work on the receiving rank: the received rows grouped by local expert (CSR), so each local
//      expert runs one GEMM pair over its rows and adds weight · output into the row's combine buffer;
//   4. the reverse all-to-all returns one summed row per (token, rank);
//   5. combine_returned: out[token] = Σ over ranks, in rank order, of the returned rows (the shared expert is
//      added locally, it is replicated).
// The summation order differs from one rank's (expert order within a rank, then rank order), so the result
// equals the single-rank MoE to rounding, not bitwise; it is fixed for a given partition, so repeats are.
//
// Everything here is host index arithmetic on plain arrays: the CPU twin runs it as is, the CUDA path builds
// the same plans on the device. Nothing here moves bytes between ranks.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace dsv4::parallel {

// Routed experts in contiguous blocks, the first (num_experts mod ep_size) ranks one larger (vLLM's linear
// placement): rank r holds [first_expert(r), first_expert(r) + num_local(r)).
class ExpertPartition {
 public:
  // Throws dsv4::Error unless 1 <= ep_size <= num_experts.
  ExpertPartition(int64_t num_experts, int ep_size);

  int64_t num_experts() const { return num_experts_; }
  int ep_size() const { return ep_size_; }
  int64_t first_expert(int rank) const;
  int64_t num_local(int rank) const;
  // Throws dsv4::Error for an expert id outside [0, num_experts).
  int owner(int64_t expert) const;

 private:
  int64_t num_experts_;
  int ep_size_;
  int64_t base_, larger_;  // every rank holds base_ experts, the first larger_ ranks one more
};

// The send side of one rank's dispatch. Rows are grouped by destination rank, ascending; within a rank, by
// source token, ascending.
struct DispatchPlan {
  int64_t top_k = 0;
  std::vector<int64_t> send_counts;   // [ep_size]: rows sent to each rank
  std::vector<int64_t> send_offsets;  // [ep_size + 1]: exclusive prefix of send_counts
  std::vector<int64_t> row_token;     // [rows]: the source token of each send row
  // [rows, top_k]: the destination's local expert ids for this row, -1 padded at the end, and their routing
  // weights (0 where the id is -1). These travel with the rows.
  std::vector<int32_t> row_local_expert;
  std::vector<float> row_weight;

  int64_t num_rows() const { return static_cast<int64_t>(row_token.size()); }
};

// `chosen` and `weights` are [tokens, top_k] (the router's output: distinct experts per token). Throws
// dsv4::Error for an out-of-range expert or a token that chose one expert twice.
DispatchPlan plan_dispatch(std::span<const int32_t> chosen, std::span<const float> weights, int64_t tokens,
                           int64_t top_k, const ExpertPartition& partition);

// Gathers the send buffer [plan.num_rows(), hidden] from the rank's activations x [tokens, hidden].
void pack_dispatch_rows(const DispatchPlan& plan, const float* x, int64_t hidden, float* send_rows);

// The receive side's grouping: for local expert e, entries [expert_offsets[e], expert_offsets[e + 1]) name the
// received rows that chose it (ascending) and the weight of each.
struct ExpertWork {
  std::vector<int64_t> expert_offsets;  // [num_local + 1]
  std::vector<int64_t> row;             // received row index
  std::vector<float> weight;
};

// `routes` and `weights` are [received_rows, top_k] as the all-to-all delivered them (every source's rows in
// source-rank order). Throws dsv4::Error for a local expert id outside [0, num_local) (a corrupt transfer).
ExpertWork plan_expert_work(std::span<const int32_t> routes, std::span<const float> weights, int64_t received_rows,
                            int64_t top_k, int64_t num_local);

// out[token] += Σ over the plan's rows of that token (rank order) of returned_rows [plan.num_rows(), hidden],
// the reverse all-to-all's result, which keeps the send order.
void combine_returned(const DispatchPlan& plan, const float* returned_rows, int64_t hidden, float* out);

}  // namespace dsv4::parallel
