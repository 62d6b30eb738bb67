// Scheduler: who runs this step and how many tokens each computes (vLLM v1 `Scheduler`, docs/research/
// kvcache_scheduler.md §1.7). It never sees a tensor: it speaks request ids and token counts to the model runner
// and asks HybridKvCacheManager for blocks.
//
// One token budget per step (max_num_batched_tokens), no prefill/decode phases:
//   (a) running requests first, oldest first: a decode computes 1 token, an ongoing chunked prefill as many as
//       the budget (and long_prefill_token_threshold) allows. Each needs manager.allocate(id, n); when the pool
//       is short the NEWEST running request is preempted by recompute (its blocks released, num_computed 0,
//       status PREEMPTED, pushed to the FRONT of the waiting queue) and the allocation retried — down to the
//       request itself, which then waits.
//   (b) then waiting requests, FCFS, while budget, max_num_seqs and blocks allow (and only in a step that
//       preempted nothing, so a request is not preempted and re-admitted in one step): manager.admit(id, its
//       prompt + generated tokens) gives the prefix hit H, the first chunk starts at H. A failed admission or
//       allocation stops admission for this step.
//
// Chunk ends: the manager hashes full 256-token blocks and takes checkpoints (SWA window + compressor state) only
// where a step ends on a 256-token boundary, so chunk ends are aligned. A prefill chunk that does not reach the end
// of the known tokens ends on a multiple of the manager's checkpoint_interval if that keeps at least one token,
// else on a multiple of 256 if that does, else where the budget ends. The final chunk ends at the last known token
// and samples — except that with checkpoint_last_full_block a final chunk that crosses a 256 boundary first stops at
// the last one (the remaining < 256 tokens run next step): without it, a prompt that fits one chunk leaves no
// checkpoint, and nothing can ever hit on it (the cache workload simulation measured a 0% hit rate).
//
// A request that can never run — prompt + max_tokens > max_model_len, or more tokens than an empty pool holds
// (manager.fits_in_pool) — is rejected by add_request() with an Error naming the numbers, never queued.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/hybrid_kv_cache_manager.h"
#include "engine/request.h"

namespace dsv4 {

struct SchedulerConfig {
  int64_t max_num_seqs = 256;                // running requests at once
  int64_t max_num_batched_tokens = 2048;     // tokens computed per step, all requests together
  int64_t max_model_len = 0;                 // prompt + max_tokens of one request; must be set (>= 2)
  int64_t long_prefill_token_threshold = 0;  // cap on one request's prefill chunk; 0 = off
  // Prefill chunk ends are aligned to multiples of this (then of 256): the cache manager's
  // PrefixCacheOptions::checkpoint_interval. align_prefill_chunks = false: chunks end where the budget does.
  int64_t checkpoint_interval = 1024;
  bool align_prefill_chunks = true;
  bool checkpoint_last_full_block = true;  // also split the final chunk at its last 256 boundary (see above)
  std::vector<int32_t> eos_token_ids;      // the model's; ignored by requests with ignore_eos

  // Throws dsv4::Error naming the field and value.
  void validate() const;
};

// One request's share of a step. `context` points into the scheduler's Request: valid until update(), which
// appends the sampled tokens.
struct ScheduledChunk {
  RequestId id = 0;
  int64_t start = 0;       // position of the chunk's first token: tokens already computed (a prefix hit included)
  int64_t num_tokens = 0;  // tokens to compute this step (1 for a decode)
  std::span<const int32_t> context;  // the request's tokens [0, start + num_tokens)
  bool samples = false;      // the chunk reaches the last known token: the step samples the next one
  bool first_chunk = false;  // first chunk since admission (new, or resumed after preemption): fresh state
  const SamplingParams* params = nullptr;  // the request's; valid until update(). nullptr: greedy
  int64_t num_prompt_tokens = 0;           // context = prompt [0, num_prompt_tokens), then generated tokens

  // The chunk's own tokens [start, start + num_tokens).
  std::span<const int32_t> token_ids() const { return context.subspan(static_cast<size_t>(start)); }
};

struct SchedulerOutput {
  uint64_t step = 0;                      // schedule() call number; update() must get this output back
  std::vector<ScheduledChunk> scheduled;  // running requests first (oldest first), then newly admitted
  std::vector<RequestId> preempted_ids;   // preempted this step: their model state is gone
  std::vector<RequestId> finished_ids;    // finished or aborted since the previous schedule(): drop their state
  int64_t num_scheduled_tokens = 0;

  void clear();
};

// What update() did to one request: the token it appended (kNoToken for none) and the request's status after it.
// Plain data: a decode step writes one per request.
struct TokenUpdate {
  RequestId id = 0;
  int32_t token = kNoToken;
  RequestStatus status = RequestStatus::kRunning;
  const std::string* error = nullptr;  // why the scheduler aborted it; valid until the next update()
  int64_t num_cached_tokens = 0;       // prompt tokens served from the prefix cache at first admission
};

class Scheduler {
 public:
  // The manager must outlive the scheduler; the scheduler is its only user of admit/allocate/commit/release.
  Scheduler(SchedulerConfig config, HybridKvCacheManager& manager);

  const SchedulerConfig& config() const { return config_; }

  // Queues a request. Throws dsv4::Error (naming the numbers) for an empty prompt, invalid sampling params
  // (validate(), engine/sampler.h), a duplicate id, prompt + max_tokens > max_model_len, or a request that could
  // never fit in the pool.
  void add_request(RequestId id, std::vector<int32_t> prompt, SamplingParams params);
  // add_request's checks short of the duplicate id, queueing nothing. Reads only the configuration and the
  // manager's fixed pool geometry (safe while another thread runs the scheduler).
  void check_request(RequestId id, std::span<const int32_t> prompt, const SamplingParams& params) const;

  // Finishes a waiting or running request as aborted and frees its blocks. False if the id is unknown or
  // finished. Safe between schedule() and update(): that step's result for it is dropped.
  bool abort(RequestId id);

  // Plans one step into `out` (cleared first; reusing one output object keeps the step allocation-free). The
  // caller runs manager.take_pending_copies() after schedule() (restores) and after update() (snapshots): the
  // manager holds the copies' blocks until then.
  void schedule(SchedulerOutput& out);
  SchedulerOutput schedule();

  // After the model ran `out`: sampled[i] is the token sampled for out.scheduled[i] (read only where samples).
  // Advances num_computed, appends the sampled tokens, calls manager.commit, applies the stop conditions and
  // releases finished requests. Appends one TokenUpdate per request that got a token or finished to `updates`
  // (cleared first).
  void update(const SchedulerOutput& out, std::span<const int32_t> sampled, std::vector<TokenUpdate>& updates);

  const Request* find(RequestId id) const;  // waiting or running; nullptr otherwise
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  int64_t num_preemptions() const { return num_preemptions_; }

  // Checks the scheduler's bookkeeping against itself and the manager (queues, statuses, computed counts,
  // ownership of blocks); throws dsv4::Error on a violation. For tests.
  void check_invariants() const;

 private:
  // Tokens the next chunk of `request` computes within `budget`, its end aligned (see the header comment).
  int64_t chunk_tokens(const Request& request, int64_t budget) const;
  void emit(Request& request, int64_t num_tokens, bool first_chunk, SchedulerOutput& out);
  void preempt(Request& request, SchedulerOutput& out);
  // Moves a request out of the live set (status already final); its blocks must be released.
  void retire(Request& request);
  RequestStatus stop_status(const Request& request, int32_t token) const;

  SchedulerConfig config_;
  HybridKvCacheManager& manager_;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;  // waiting and running
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;  // admission order: oldest first, the preemption victim last
  std::vector<std::unique_ptr<Request>> retired_;  // finished since the last schedule(): outputs may point here
  std::vector<RequestId> finished_since_schedule_;
  // Requests the scheduler aborted itself: reported by the next update(), their errors kept until the one after.
  std::vector<std::unique_ptr<Request>> unreported_aborts_, reported_aborts_;
  std::vector<Request*> step_requests_;  // parallel to the last output's `scheduled`
  uint64_t step_ = 0;
  bool step_open_ = false;  // schedule() ran, update() not yet
  uint64_t next_arrival_ = 0;
  int64_t num_preemptions_ = 0;
};

}  // namespace dsv4
