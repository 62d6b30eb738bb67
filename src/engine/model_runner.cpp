#include "engine/model_runner.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {

ModelRunner::ModelRunner(ModelBackend& backend) : backend_(backend) {
  for (const int64_t id : backend.config().eos_token_ids) eos_token_ids_.push_back(static_cast<int32_t>(id));
}

void ModelRunner::execute_copies(std::span<const BlockCopy> copies) {
  if (copies.empty()) return;
  if (copy_executor_) copy_executor_(copies);
  else backend_.copy_blocks(copies);
}

std::unique_ptr<SequenceState> ModelRunner::make_state(const ScheduledChunk& chunk) {
  // The one place a request's model state is created.
  if (state_factory_) return state_factory_(chunk);
  return backend_.make_state(chunk.id);
}

void ModelRunner::execute(const SchedulerOutput& out, std::vector<int32_t>& sampled) {
  for (const RequestId id : out.finished_ids) release(id);
  for (const RequestId id : out.preempted_ids) states_.erase(id);
  logprobs_.clear();
  sampled.assign(out.scheduled.size(), kNoToken);
  if (out.scheduled.empty()) {
    if (forward_every_step_) backend_.forward({}, LogitsMode::kLastPerSequence);
    return;
  }

  batch_.clear();
  for (const ScheduledChunk& chunk : out.scheduled) {
    std::unique_ptr<SequenceState>& state = states_[chunk.id];
    if (chunk.first_chunk || !state) state = make_state(chunk);
    const int64_t have = state->num_tokens();
    if (have > chunk.start)
      throw Error("model runner: request " + std::to_string(chunk.id) + " has state for " + std::to_string(have) +
                  " tokens but its chunk starts at " + std::to_string(chunk.start));
    num_recomputed_tokens_ += chunk.start - have;
    batch_.push_back({state.get(), chunk.context.subspan(static_cast<size_t>(have))});
  }
  if (backend_.samples_on_device()) {
    execute_on_device(out, sampled);
    return;
  }
  const Tensor logits = backend_.forward(batch_, LogitsMode::kLastPerSequence);
  const int64_t vocab = backend_.config().vocab_size;
  if (logits.numel() != static_cast<int64_t>(out.scheduled.size()) * vocab)
    throw Error("model runner: logits " + logits.shape_string() + " for " + std::to_string(out.scheduled.size()) +
                " requests");
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const ScheduledChunk& chunk = out.scheduled[i];
    if (!chunk.samples) continue;
    const std::span<const float> row(logits.ptr() + static_cast<int64_t>(i) * vocab, static_cast<size_t>(vocab));
    if (!chunk.params) {
      sampled[i] = argmax_token(row);
      continue;
    }
    SampleResult* result = chunk.params->logprobs ? &logprobs_[chunk.id] : nullptr;
    sampled[i] = sample(row, *chunk.params, sampler_state(chunk), chunk.context, result);
  }
}

RequestSamplerState& ModelRunner::sampler_state(const ScheduledChunk& chunk) {
  auto state = sampler_states_.find(chunk.id);
  if (state == sampler_states_.end())
    state = sampler_states_.emplace(chunk.id, make_sampler_state(*chunk.params, chunk.num_prompt_tokens,
                                                                 eos_token_ids_)).first;
  return state->second;
}

// The backend samples next to its logits: the same order of generator draws as the host path (one per sampled
// row, in batch order), so a seeded request gets the same tokens either way.
void ModelRunner::execute_on_device(const SchedulerOutput& out, std::vector<int32_t>& sampled) {
  device_rows_.clear();
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const ScheduledChunk& chunk = out.scheduled[i];
    if (!chunk.samples) continue;
    DeviceSampleRow row;
    row.batch_index = i;
    if (chunk.params) {
      row.params = &*chunk.params;
      row.state = &sampler_state(chunk);
    }
    row.context = chunk.context;
    device_rows_.push_back(row);
  }
  backend_.forward_and_sample(batch_, device_rows_, device_results_);
  for (size_t j = 0; j < device_rows_.size(); ++j) {
    const DeviceSampleRow& row = device_rows_[j];
    sampled[row.batch_index] = device_results_[j].token;
    if (row.params && row.params->logprobs) logprobs_[out.scheduled[row.batch_index].id] = device_results_[j];
  }
}

}  // namespace dsv4
