// The GPU transport of the expert-parallel all-to-alls (docs/parallel.md): NCCL grouped send/receive between the
// ranks of an NCCL communicator, one GPU per rank. Issue 9's deployment runs one process per GPU, connected by
// NCCL's own bootstrap (ncclGetUniqueId on rank 0, the id handed to the others by the launcher); a test or a
// single-process run may instead hold one communicator per visible device (NcclCommunicator::for_devices).
//
// Memory: all_to_all_v's buffers are device memory of this rank's GPU; it enqueues on the communicator's stream
// and returns without waiting (stream order is the contract, as for any kernel). exchange_counts takes and
// returns host counts, so it stages them through the device and waits for the stream.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace dsv4::parallel {

class NcclCommunicator final : public Communicator {
 public:
  // Joins rank `rank` of `size` ranks identified by `id` (every rank passes the same id); the current CUDA
  // device is this rank's GPU. Throws dsv4::Error with NCCL's message on failure.
  NcclCommunicator(const ncclUniqueId& id, int size, int rank, cudaStream_t stream);
  // One communicator per device of `devices` in this process (ncclCommInitAll): rank i runs on devices[i] and
  // must be driven from its own thread, with that device current.
  static std::vector<std::unique_ptr<NcclCommunicator>> for_devices(const std::vector<int>& devices);
  // One process per rank: rank 0 makes the id (ncclGetUniqueId, its bytes to hand to the other processes), every
  // rank joins with it on the current device, on a stream of its own; blocks until all `size` ranks have joined.
  static std::string new_unique_id();
  static std::unique_ptr<NcclCommunicator> join(const std::string& unique_id, int size, int rank);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  cudaStream_t stream() const { return stream_; }
  void all_to_all_v(const void* send, std::span<const int64_t> send_bytes, void* recv,
                    std::span<const int64_t> recv_bytes) override;
  std::vector<int64_t> exchange_counts(std::span<const int64_t> send_counts) override;
  void synchronize() override;  // waits for the communicator's stream
  // ncclCommAbort on this rank's communicator; later collectives throw `reason`.
  void abort(const std::string& reason) override;

 private:
  NcclCommunicator(ncclComm_t comm, int size, int rank, cudaStream_t stream, bool owns_stream);
  ncclComm_t comm_ = nullptr;
  int size_ = 0, rank_ = 0;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  int64_t* staging_ = nullptr;  // device [2 · size] counts for exchange_counts
  std::string abort_reason_;    // set once aborted (comm_ is then gone)
};

}  // namespace dsv4::parallel
