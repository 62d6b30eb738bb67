// DataParallelEngine: data-parallel attention serving in one process (issue 9). N ranks, each a whole Engine
// — its own scheduler, its own HybridKvCacheManager (so its own prefix cache) and its own backend arena —
// stepping on its own thread; a front end, driven by one thread through the ServingEngine interface exactly
// as a single Engine is (server/engine_service.h, `dsv4 generate`), routes every new request with
// DataParallelRouter and gathers the ranks' outputs.
//
// Routing data: after every step a rank reports its outputs, the progress of the requests it scheduled or
// preempted (router on_progress) and the net change of its prefix cache (HybridKvCacheManager::
// drain_prefix_cache_events -> router on_blocks_cached / on_blocks_evicted). The front applies reports in
// step(); it reports on_admitted itself when it hands a request to a rank (with the router's prefix estimate,
// corrected by the first progress report), so a burst of requests routed between two steps sees its own load.
//
// Failure: a rank whose step throws (a model failure, a device error) is marked failed. Its unfinished
// requests — those it runs and those still in its inbox — finish with status kFinishedAborted and an error
// naming the rank and the cause; the engine aborts them so their blocks go back to its pool; the router never
// picks the rank again; the other ranks keep serving. When every rank has failed, add_request throws.
//
// Processes: a rank may run in a worker process of its own (RemoteRankEngine, engine/remote_rank_engine.h: one
// process per GPU, `dsv4 serve --data-parallel-backend mp`). Its thread here drives it over a socket through the
// same loop; a worker that dies fails its rank at once (the socket closes), as a throwing step does.
//
// Weights: the ranks' backends may share read-only weights (CpuModelBackends over one DeepseekV4Model: the
// CPU forward only reads the model) — each backend still owns its rank's KV arena.
//
// Lockstep (expert parallelism, docs/parallel.md): when the ranks' models split the routed experts between them
// (DeepseekV4Model::set_expert_parallel), every MoE sublayer is a collective over all ranks, so the ranks must
// run their forwards together. With `lockstep` the ranks meet at a gate before every step: when any of them has
// work, all of them step, a rank with nothing scheduled over an empty batch (EngineConfig::forward_every_step);
// when none has, all of them sleep until a request or an abort arrives anywhere. A rank that fails leaves the
// gate and aborts every rank's collectives (RankEngine::abort_collectives): the other ranks, waiting for it
// in a collective of the same step, then fail too, with an error naming it, instead of hanging — with the
// experts split, no rank can serve without the failed one's. A rank that hangs instead of throwing is caught by
// its peers' collective deadline (parallel/deadline_communicator.h, the CLI's --dist-timeout): they abort the
// group and fail the same way.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/dp_router.h"
#include "engine/engine.h"
#include "engine/rank_engine.h"
#include "engine/serving_engine.h"

namespace dsv4 {

class DataParallelEngine final : public ServingEngine {
 public:
  // One backend per rank in this process (rank i runs LocalRankEngine(rank_backends[i], rank_config(config)));
  // they must outlive the engine. `remote_ranks` follow them as ranks rank_backends.size().. (their workers built
  // their engines with rank_config(config, lockstep)); rank 0 must be local: it checks every request for the
  // others. `router`'s num_ranks and prefill_tokens_per_step are set here from the rank count and
  // config.max_num_batched_tokens; its prefix_cache_salt must stay "" (EngineConfig has no salt). Throws
  // dsv4::Error for no local rank, or local backends of different models.
  DataParallelEngine(std::vector<ModelBackend*> rank_backends, EngineConfig config,
                     DataParallelRouterConfig router = {}, bool lockstep = false,
                     std::vector<std::unique_ptr<RankEngine>> remote_ranks = {});
  // Stops and joins the rank threads; unfinished requests are dropped without an output.
  ~DataParallelEngine() override;
  DataParallelEngine(const DataParallelEngine&) = delete;
  DataParallelEngine& operator=(const DataParallelEngine&) = delete;

  // The config every rank's Engine runs: the ranks report prefix-cache events to the router, and lockstep ranks
  // step every round (EngineConfig::forward_every_step).
  static EngineConfig rank_config(EngineConfig config, bool lockstep);

  RequestId add_request(std::vector<int32_t> prompt, SamplingParams params = {}) override;
  bool abort(RequestId id) override;
  // The outputs of every rank step reported since the last call; waits up to `report_wait` for one when there
  // is none and requests are unfinished (a rank mid-prefill reports steps with no output: the wait ends then
  // too). Returns nothing at once when nothing is unfinished.
  std::vector<RequestOutput> step() override;
  // Requests unfinished, or aborts a rank has not applied yet: until it has, the aborted request's blocks are
  // still held there and the stats say so, so a front end keeps stepping (and publishing them) until then.
  bool has_unfinished() const override { return !live_.empty() || unapplied_aborts_ > 0; }
  int64_t max_model_len() const override { return max_model_len_; }
  EngineStats stats() const override;  // the live ranks' sum

  int num_ranks() const { return static_cast<int>(ranks_.size()); }
  // The rank an unfinished request was routed to; -1 once it finished, or for an unknown id.
  int rank_of(RequestId id) const;
  bool rank_failed(int rank) const;
  // A rank's figures as of its last step (a failed rank's: after its requests were aborted).
  EngineStats rank_stats(int rank) const;
  const DataParallelRouter& router() const { return router_; }

  std::chrono::milliseconds report_wait{200};

 private:
  struct Rank {
    int index = 0;
    std::unique_ptr<RankEngine> engine;  // after construction, driven by the rank's thread only (check_request aside)
    std::thread thread;
    // Guards the fields below.
    mutable std::mutex mutex;
    std::condition_variable wake;
    std::deque<RankCommand> inbox;
    bool stopping = false, failed = false;
    std::string failure;
    EngineStats stats;
  };

  // Where lockstep ranks meet before each step (see the file comment).
  class LockstepGate {
   public:
    enum class Decision { kStep, kIdle, kStop };
    explicit LockstepGate(int members) : members_(members) {}
    // Blocks until every member has arrived in this round: kStep when any of them has work, else kIdle.
    Decision arrive(bool has_work);
    // A failed rank stops taking part; a round it was the last one missing completes.
    void leave();
    // Counts commands posted to any rank: after an idle round a rank sleeps until it moves past what the rank
    // saw before taking its inbox, or until another rank arrives for the next round.
    uint64_t commands_posted() const;
    void command_posted();
    void wait_for_commands(uint64_t seen);
    void stop();

   private:
    void complete_round();  // under mutex_
    mutable std::mutex mutex_;
    std::condition_variable wake_;
    int members_ = 0, arrived_ = 0;
    bool any_work_ = false, stopping_ = false;
    Decision decision_ = Decision::kIdle;
    uint64_t round_ = 0, commands_ = 0;
  };

  void run_rank(Rank& rank);
  // Marks `rank` failed, aborts everything it holds and fills `report` with the error outputs.
  void fail_rank(Rank& rank, const std::string& cause, RankReport& report);
  void post_report(RankReport report);

  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<LockstepGate> lockstep_;  // null: the ranks step independently
  DataParallelRouter router_;
  int64_t max_model_len_ = 0;

  std::mutex reports_mutex_;
  std::condition_variable reports_ready_;
  std::vector<RankReport> reports_;

  // Front thread only.
  RequestId next_id_ = 0;
  std::unordered_map<RequestId, int> live_;  // unfinished requests -> rank
  int64_t unapplied_aborts_ = 0;             // abort commands posted whose report has not come back
};

}  // namespace dsv4
