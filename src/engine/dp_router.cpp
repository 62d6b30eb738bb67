#include "engine/dp_router.h"

#include <algorithm>
#include <cmath>

#include "cache/block_hash.h"
#include "cache/cache_spec.h"
#include "core/error.h"

namespace dsv4 {
namespace {

std::string n(int64_t value) { return std::to_string(value); }
std::string d(double value) { return std::to_string(value); }

}  // namespace

void DataParallelRouterConfig::validate() const {
  DSV4_CHECK(num_ranks >= 1, "num_ranks = " + n(num_ranks) + ": must be at least 1");
  DSV4_CHECK(prefill_tokens_per_step >= 1,
             "prefill_tokens_per_step = " + n(prefill_tokens_per_step) + ": must be at least 1");
  DSV4_CHECK(std::isfinite(decode_request_step_cost) && decode_request_step_cost >= 0,
             "decode_request_step_cost = " + d(decode_request_step_cost) + ": must be finite and >= 0");
  DSV4_CHECK(std::isfinite(index_scan_step_cost_per_context_token) && index_scan_step_cost_per_context_token >= 0,
             "index_scan_step_cost_per_context_token = " + d(index_scan_step_cost_per_context_token) +
                 ": must be finite and >= 0");
  DSV4_CHECK(std::isfinite(balance_abs_threshold) && balance_abs_threshold >= 0,
             "balance_abs_threshold = " + d(balance_abs_threshold) + ": must be finite and >= 0");
  DSV4_CHECK(std::isfinite(balance_rel_threshold) && balance_rel_threshold >= 1,
             "balance_rel_threshold = " + d(balance_rel_threshold) + ": must be finite and >= 1");
}

DataParallelRouter::DataParallelRouter(DataParallelRouterConfig config) : config_(std::move(config)) {
  config_.validate();
  root_hash_ = prefix_root_hash(config_.prefix_cache_salt);
  loads_.resize(static_cast<size_t>(config_.num_ranks));
  cached_blocks_.resize(static_cast<size_t>(config_.num_ranks));
  failed_.assign(static_cast<size_t>(config_.num_ranks), false);
}

void DataParallelRouter::check_rank(int rank) const {
  DSV4_CHECK(rank >= 0 && rank < config_.num_ranks,
             "rank " + n(rank) + " outside [0, " + n(config_.num_ranks) + ")");
}

std::vector<uint64_t> DataParallelRouter::prompt_block_hashes(std::span<const int32_t> prompt_tokens) const {
  // As HybridKvCacheManager::admit: a hit always leaves at least one prompt token to compute.
  const int64_t max_blocks = (static_cast<int64_t>(prompt_tokens.size()) - 1) / kLogicalBlockTokens;
  return logical_block_hashes(root_hash_, prompt_tokens, max_blocks);
}

int64_t DataParallelRouter::matched_prefix_tokens(int rank, std::span<const uint64_t> prompt_hashes) const {
  check_rank(rank);
  const auto& cached = cached_blocks_[static_cast<size_t>(rank)];
  int64_t blocks = 0;
  for (const uint64_t h : prompt_hashes) {  // chain hashes: a block's hash names its whole prefix
    if (!cached.count(h)) break;
    ++blocks;
  }
  return blocks * kLogicalBlockTokens;
}

double DataParallelRouter::cost(int rank, int64_t prompt_tokens, int64_t matched_tokens) const {
  check_rank(rank);
  const RankLoad& load = loads_[static_cast<size_t>(rank)];
  const int64_t queue_delay = load.queued_prefill_tokens;
  const int64_t uncached_prefill = prompt_tokens - matched_tokens;
  const int64_t prefill_ahead = queue_delay + uncached_prefill;
  const int64_t steps = std::max<int64_t>(1, (prefill_ahead + config_.prefill_tokens_per_step - 1) /
                                                 config_.prefill_tokens_per_step);
  const double decode_step_load =
      static_cast<double>(load.running_decode_requests) * config_.decode_request_step_cost +
      static_cast<double>(load.decode_context_tokens) * config_.index_scan_step_cost_per_context_token;
  return static_cast<double>(prefill_ahead) + static_cast<double>(steps) * decode_step_load;
}

RankChoice DataParallelRouter::route(std::span<const int32_t> prompt_tokens) const {
  const std::vector<uint64_t> hashes = prompt_block_hashes(prompt_tokens);
  const int64_t prompt = static_cast<int64_t>(prompt_tokens.size());
  DSV4_CHECK(num_live_ranks() > 0,
             "every one of the " + n(config_.num_ranks) + " data-parallel ranks has failed");
  RankChoice holder, cheapest;  // the least-loaded holder of the longest prefix; the cheapest rank overall
  bool first = true;
  for (int rank = 0; rank < config_.num_ranks; ++rank) {
    if (failed_[static_cast<size_t>(rank)]) continue;
    const int64_t matched = matched_prefix_tokens(rank, hashes);
    const double c = cost(rank, prompt, matched);
    // Strict comparisons: among equals the lowest rank, seen first, stays.
    if (first || matched > holder.matched_prefix_tokens ||
        (matched == holder.matched_prefix_tokens && c < holder.cost))
      holder = {rank, matched, c, false};
    if (first || c < cheapest.cost) cheapest = {rank, matched, c, false};
    first = false;
  }
  const bool queue_cost_wins = holder.cost - cheapest.cost > config_.balance_abs_threshold &&
                               holder.cost > config_.balance_rel_threshold * cheapest.cost;
  if (!queue_cost_wins) return holder;
  cheapest.affinity_broken = cheapest.matched_prefix_tokens < holder.matched_prefix_tokens;
  return cheapest;
}

void DataParallelRouter::add_contribution(const TrackedRequest& request, int sign) {
  RankLoad& load = loads_[static_cast<size_t>(request.rank)];
  load.queued_prefill_tokens += sign * request.queued_prefill_tokens;
  if (request.decoding) {
    load.running_decode_requests += sign;
    load.decode_context_tokens += sign * request.context_tokens;
  }
}

void DataParallelRouter::mark_rank_failed(int rank) {
  check_rank(rank);
  failed_[static_cast<size_t>(rank)] = true;
  cached_blocks_[static_cast<size_t>(rank)].clear();
  std::erase_if(requests_, [rank](const auto& entry) { return entry.second.rank == rank; });
  loads_[static_cast<size_t>(rank)] = RankLoad{};
}

bool DataParallelRouter::rank_failed(int rank) const {
  check_rank(rank);
  return failed_[static_cast<size_t>(rank)];
}

int DataParallelRouter::num_live_ranks() const {
  return static_cast<int>(std::count(failed_.begin(), failed_.end(), false));
}

void DataParallelRouter::on_admitted(int rank, RequestId id, int64_t prompt_tokens, int64_t cached_prompt_tokens) {
  check_rank(rank);
  DSV4_CHECK(!failed_[static_cast<size_t>(rank)], "rank " + n(rank) + " has failed: it admits nothing");
  const std::string what = "request " + std::to_string(id);
  DSV4_CHECK(requests_.count(id) == 0, what + ": already admitted");
  DSV4_CHECK(prompt_tokens >= 1, what + ": prompt of " + n(prompt_tokens) + " tokens");
  DSV4_CHECK(cached_prompt_tokens >= 0 && cached_prompt_tokens < prompt_tokens,
             what + ": " + n(cached_prompt_tokens) + " cached tokens of a " + n(prompt_tokens) + "-token prompt");
  TrackedRequest request;
  request.rank = rank;
  request.prompt_tokens = prompt_tokens;
  request.queued_prefill_tokens = prompt_tokens - cached_prompt_tokens;
  add_contribution(request, +1);
  requests_.emplace(id, request);
}

void DataParallelRouter::on_progress(RequestId id, int64_t num_computed_tokens, int64_t num_tokens) {
  const auto it = requests_.find(id);
  DSV4_CHECK(it != requests_.end(), "request " + std::to_string(id) + ": progress reported but never admitted");
  TrackedRequest& request = it->second;
  DSV4_CHECK(num_computed_tokens >= 0 && num_computed_tokens <= num_tokens && num_tokens >= request.prompt_tokens,
             "request " + std::to_string(id) + ": " + n(num_computed_tokens) + " computed of " + n(num_tokens) +
                 " tokens (prompt " + n(request.prompt_tokens) + ")");
  add_contribution(request, -1);
  request.decoding = num_computed_tokens >= request.prompt_tokens;
  request.queued_prefill_tokens = request.decoding ? 0 : request.prompt_tokens - num_computed_tokens;
  request.context_tokens = request.decoding ? num_tokens : 0;
  add_contribution(request, +1);
}

bool DataParallelRouter::on_finished(RequestId id) {
  const auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  add_contribution(it->second, -1);
  requests_.erase(it);
  return true;
}

void DataParallelRouter::on_blocks_cached(int rank, std::span<const uint64_t> block_hashes) {
  check_rank(rank);
  if (failed_[static_cast<size_t>(rank)]) return;  // a failed rank's late report: it serves nothing any more
  cached_blocks_[static_cast<size_t>(rank)].insert(block_hashes.begin(), block_hashes.end());
}

void DataParallelRouter::on_blocks_evicted(int rank, std::span<const uint64_t> block_hashes) {
  check_rank(rank);
  for (const uint64_t h : block_hashes) cached_blocks_[static_cast<size_t>(rank)].erase(h);
}

const RankLoad& DataParallelRouter::load(int rank) const {
  check_rank(rank);
  return loads_[static_cast<size_t>(rank)];
}

int64_t DataParallelRouter::num_cached_blocks(int rank) const {
  check_rank(rank);
  return static_cast<int64_t>(cached_blocks_[static_cast<size_t>(rank)].size());
}

}  // namespace dsv4
