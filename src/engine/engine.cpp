#include "engine/engine.h"

#include "core/error.h"

namespace dsv4 {
namespace {

SchedulerConfig scheduler_config(const EngineConfig& config, const ModelConfig& model) {
  SchedulerConfig out;
  out.max_num_seqs = config.max_num_seqs;
  out.max_num_batched_tokens = config.max_num_batched_tokens;
  out.max_model_len = config.max_model_len > 0 ? config.max_model_len : model.max_position_embeddings;
  out.long_prefill_token_threshold = config.long_prefill_token_threshold;
  out.checkpoint_interval = config.checkpoint_interval;
  out.align_prefill_chunks = config.enable_prefix_caching;  // the boundaries only matter to the prefix cache
  for (const int64_t id : model.eos_token_ids) out.eos_token_ids.push_back(static_cast<int32_t>(id));
  return out;
}

HybridKvCacheManager make_manager(const EngineConfig& config, const ModelBackend& backend) {
  DSV4_CHECK(config.kv_cache_bytes > 0, "kv_cache_bytes = " + std::to_string(config.kv_cache_bytes) + ": must be positive");
  PrefixCacheOptions options;
  options.enabled = config.enable_prefix_caching;
  options.checkpoint_interval = config.checkpoint_interval;
  options.record_events = config.record_prefix_cache_events;
  return HybridKvCacheManager(CacheLayout::for_model(backend.config(), backend.kv_storage(), backend.index_storage()),
                              config.kv_cache_bytes, options);
}

}  // namespace

Engine::Engine(DeepseekV4Model& model, EngineConfig config)
    : Engine(std::make_unique<CpuModelBackend>(model), nullptr, config) {}

Engine::Engine(ModelBackend& backend, EngineConfig config) : Engine(nullptr, &backend, config) {}

// `owned`, when given, is the backend (`backend` is then null).
Engine::Engine(std::unique_ptr<ModelBackend> owned, ModelBackend* backend, EngineConfig config)
    : config_(config),
      owned_backend_(std::move(owned)),
      backend_(owned_backend_ ? *owned_backend_ : *backend),
      manager_(make_manager(config_, backend_)),
      scheduler_(scheduler_config(config_, backend_.config()), manager_),
      runner_(backend_) {
  // Every request's state lives in the backend's arena, addressed through the manager's block tables.
  backend_.bind_cache(manager_);
  runner_.set_forward_every_step(config_.forward_every_step);
}

void Engine::check_request(RequestId id, std::span<const int32_t> prompt,
                           const SamplingParams& params) const {
  const int64_t vocab = backend_.config().vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= vocab)
      throw Error("request " + std::to_string(id) + ": prompt token " + std::to_string(i) + " = " +
                  std::to_string(prompt[i]) + " is outside the vocabulary of " + std::to_string(vocab));
  scheduler_.check_request(id, prompt, params);
}

RequestId Engine::add_request(std::vector<int32_t> prompt, SamplingParams params) {
  const RequestId id = next_id_;
  check_request(id, prompt, params);
  scheduler_.add_request(id, std::move(prompt), std::move(params));
  ++next_id_;
  return id;
}

std::vector<RequestId> Engine::add_parallel_requests(const std::vector<int32_t>& prompt, const SamplingParams& params,
                                                     int64_t n) {
  DSV4_CHECK(n >= 1 && n <= 128, "n = " + std::to_string(n) + ": must be in [1, 128]");
  validate(params);  // reject before queueing any child
  std::vector<RequestId> ids;
  for (int64_t i = 0; i < n; ++i) {
    SamplingParams child = params;
    if (child.seed) child.seed = *child.seed + static_cast<uint64_t>(i);
    ids.push_back(add_request(prompt, child));
  }
  return ids;
}

EngineStats Engine::stats() const {
  EngineStats stats;
  stats.running = scheduler_.num_running();
  stats.waiting = scheduler_.num_waiting();
  stats.preemptions = scheduler_.num_preemptions();
  const BlockPool::Usage usage = manager_.pool().usage();
  stats.pool_bytes = usage.pool_bytes;
  stats.used_bytes = usage.used_block_bytes;
  stats.cached_bytes = usage.cached_block_bytes;
  const auto& groups = manager_.layout().groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    EngineStats::Group& group = stats.groups.emplace_back();
    group.kind = groups[g].kind;
    group.used_blocks = g < usage.used_blocks_per_group.size() ? usage.used_blocks_per_group[g] : 0;
    group.cached_blocks = g < usage.cached_blocks_per_group.size() ? usage.cached_blocks_per_group[g] : 0;
    group.capacity_blocks =
        manager_.pool().num_pages() * manager_.pool().blocks_per_page(static_cast<int>(g));
  }
  const HybridKvCacheManager::Stats& prefix = manager_.stats();
  stats.prefix_queries = prefix.prefix_queries;
  stats.prefix_query_tokens = prefix.prefix_query_tokens;
  stats.prefix_hit_tokens = prefix.prefix_hit_tokens;
  return stats;
}

void EngineStats::accumulate(const EngineStats& other) {
  running += other.running;
  waiting += other.waiting;
  preemptions += other.preemptions;
  pool_bytes += other.pool_bytes;
  used_bytes += other.used_bytes;
  cached_bytes += other.cached_bytes;
  if (groups.empty())
    groups = other.groups;
  else
    for (size_t g = 0; g < groups.size() && g < other.groups.size(); ++g) {
      groups[g].used_blocks += other.groups[g].used_blocks;
      groups[g].cached_blocks += other.groups[g].cached_blocks;
      groups[g].capacity_blocks += other.groups[g].capacity_blocks;
    }
  prefix_queries += other.prefix_queries;
  prefix_query_tokens += other.prefix_query_tokens;
  prefix_hit_tokens += other.prefix_hit_tokens;
}

bool Engine::abort(RequestId id) {
  if (!scheduler_.abort(id)) return false;
  runner_.release(id);
  return true;
}

std::vector<RequestOutput> Engine::step() {
  scheduler_.schedule(scheduled_);
  runner_.execute_copies(manager_.take_pending_copies());  // restores for this step's prefix hits
  runner_.execute(scheduled_, sampled_);
  scheduler_.update(scheduled_, sampled_, updates_);
  runner_.execute_copies(manager_.take_pending_copies());  // checkpoint snapshots of the state just computed

  std::vector<RequestOutput> outputs;
  outputs.reserve(updates_.size());
  for (const TokenUpdate& update : updates_) {
    RequestOutput& output = outputs.emplace_back();
    output.id = update.id;
    if (update.token != kNoToken) {
      output.new_token_ids.push_back(update.token);
      if (const SampleResult* logprobs = runner_.last_logprobs(update.id)) output.new_logprobs.push_back(*logprobs);
    }
    output.status = update.status;
    output.finished = is_finished(update.status);
    if (update.error) output.error = *update.error;
    output.num_cached_tokens = update.num_cached_tokens;
    if (output.finished) runner_.release(update.id);
  }
  return outputs;
}

}  // namespace dsv4
