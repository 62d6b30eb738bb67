#include "parallel/expert_parallel_moe.h"

#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"

namespace dsv4::parallel {

namespace {

std::vector<int64_t> scaled(std::span<const int64_t> counts, int64_t bytes_per_count) {
  std::vector<int64_t> bytes(counts.begin(), counts.end());
  for (int64_t& b : bytes) b *= bytes_per_count;
  return bytes;
}

}  // namespace

void expert_parallel_moe(Communicator& comm, const ExpertPartition& partition, int64_t hidden, int64_t top_k,
                         const float* x, int64_t tokens, std::span<const int32_t> chosen,
                         std::span<const float> weights, const LocalExpertFn& run_expert, float* out) {
  DSV4_CHECK(partition.ep_size() == comm.size(), "the expert partition is over " + std::to_string(partition.ep_size()) +
                                                     " ranks, the communicator has " + std::to_string(comm.size()));
  const int64_t D = hidden;
  // 1. The dispatch plan and its rows.
  const DispatchPlan plan = plan_dispatch(chosen, weights, tokens, top_k, partition);
  std::vector<float> send_rows(static_cast<size_t>(plan.num_rows() * D));
  pack_dispatch_rows(plan, x, D, send_rows.data());

  // 2. Counts first, then the rows, their local expert ids and their weights.
  const std::vector<int64_t> recv_counts = comm.exchange_counts(plan.send_counts);
  int64_t received = 0;
  for (const int64_t count : recv_counts) received += count;
  std::vector<float> rows(static_cast<size_t>(received * D));
  std::vector<int32_t> routes(static_cast<size_t>(received * top_k));
  std::vector<float> route_weights(static_cast<size_t>(received * top_k));
  // Byte sizes per rank: a row is D floats, its routes and its weights top_k 4-byte values each.
  const auto row_bytes = static_cast<int64_t>(D * sizeof(float));
  const auto route_bytes = static_cast<int64_t>(top_k * sizeof(int32_t));
  static_assert(sizeof(int32_t) == sizeof(float), "routes and weights travel with the same sizes");
  const std::vector<int64_t> send_row_bytes = scaled(plan.send_counts, row_bytes),
                             recv_row_bytes = scaled(recv_counts, row_bytes),
                             send_route_bytes = scaled(plan.send_counts, route_bytes),
                             recv_route_bytes = scaled(recv_counts, route_bytes);
  comm.all_to_all_v(send_rows.data(), send_row_bytes, rows.data(), recv_row_bytes);
  comm.all_to_all_v(plan.row_local_expert.data(), send_route_bytes, routes.data(), recv_route_bytes);
  comm.all_to_all_v(plan.row_weight.data(), send_route_bytes, route_weights.data(), recv_route_bytes);

  // 3. Each local expert over the received rows that chose it, summed per received row.
  const int64_t num_local = partition.num_local(comm.rank());
  const ExpertWork work = plan_expert_work(routes, route_weights, received, top_k, num_local);
  std::vector<float> combined(static_cast<size_t>(received * D), 0.0f);
  std::vector<float> gathered, partial;
  for (int64_t e = 0; e < num_local; ++e) {
    const int64_t begin = work.expert_offsets[e], n = work.expert_offsets[e + 1] - begin;
    if (n == 0) continue;
    gathered.resize(static_cast<size_t>(n * D));
    partial.assign(static_cast<size_t>(n * D), 0.0f);
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(&gathered[i * D], &rows[work.row[begin + i] * D], D * sizeof(float));
    run_expert(e, gathered.data(), n, &work.weight[begin], partial.data());
    for (int64_t i = 0; i < n; ++i) {
      float* target = &combined[work.row[begin + i] * D];
      for (int64_t j = 0; j < D; ++j) target[j] += partial[i * D + j];
    }
  }

  // 4. The summed rows go back in the order they came (the receive runs, by source rank), 5. combined in rank order.
  std::vector<float> returned(static_cast<size_t>(plan.num_rows() * D));
  comm.all_to_all_v(combined.data(), recv_row_bytes, returned.data(), send_row_bytes);
  combine_returned(plan, returned.data(), D, out);
}

}  // namespace dsv4::parallel
