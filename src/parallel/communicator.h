// The collective the expert-parallel MoE needs (docs/parallel.md): an all-to-all with per-pair sizes, between the
// ranks of one group. Two transports: in-process ranks (threads sharing host memory — the CPU backend's ranks and
// the tests) here, and NCCL between GPUs (parallel/nccl_communicator.h), one process per GPU.
//
// A collective is called by every rank of the group, in the same order; a rank with nothing to send still calls
// it (zero sizes), as the data-parallel-attention ranks of one MoE step all take part in its all-to-alls.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace dsv4::parallel {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // `send` holds size() runs back to back, run d (send_bytes[d] bytes) for rank d; `recv` gets size() runs back
  // to back, run s (recv_bytes[s] bytes) from rank s. recv_bytes[s] must equal what rank s sends here (exchange
  // the sizes first, exchange_counts). A rank's run for itself is copied locally. The buffers live where the
  // transport moves bytes: host memory in-process, this rank's device memory for NCCL. A rank that fails a
  // collective must still call the group's later ones, or the others wait for it.
  virtual void all_to_all_v(const void* send, std::span<const int64_t> send_bytes, void* recv,
                            std::span<const int64_t> recv_bytes) = 0;

  // Blocks until this rank's last all_to_all_v has delivered its receive buffer: a transport that only enqueues
  // (NCCL, on its own stream) waits for its stream; the in-process group's copies are done when it returns.
  virtual void synchronize() {}

  // Every rank gives size() counts (what it will send to each rank); returns what each rank sends to this one.
  // Host memory on every transport.
  virtual std::vector<int64_t> exchange_counts(std::span<const int64_t> send_counts);

  // This rank is failing and will call no further collective: the group is unusable from here on. Each later
  // collective on this rank throws dsv4::Error naming `reason`; the in-process group also wakes the other ranks
  // waiting in a collective, which then throw the same error instead of waiting for this rank forever (NCCL
  // aborts this rank's communicator; its peers in other processes need their own abort). Idempotent.
  virtual void abort(const std::string& reason) = 0;
};

// How an in-process group moves bytes. The default is host memory: memcpy, nothing before or after. A group of
// ranks on one GPU (parallel/device_in_process_group.h) copies on each rank's stream instead, waits for the rank's
// stream before publishing its send buffer (the kernels that write it may still run) and after its copies.
struct InProcessTransport {
  std::function<void(int rank, void* dst, const void* src, size_t bytes)> copy;  // null: memcpy
  std::function<void(int rank)> before_post, after_copies;                       // null: nothing
};

// size() ranks in one process, one thread each: rank r's communicator is communicator(r). A collective copies
// straight from the senders' buffers: every rank publishes its buffer, a barrier, every rank copies the runs
// addressed to it, a barrier (so no sender reuses its buffer before every reader is done). The group must outlive
// its communicators; every rank must call each collective (a rank that stops calling blocks the others).
class InProcessGroup {
 public:
  explicit InProcessGroup(int size, InProcessTransport transport = {});  // throws dsv4::Error unless size >= 1
  int size() const { return size_; }
  std::unique_ptr<Communicator> communicator(int rank);  // throws dsv4::Error for a rank outside [0, size)

 private:
  class Member;
  struct Posted {
    const uint8_t* send = nullptr;
    std::vector<int64_t> offsets;  // [size + 1]: where each destination's run starts
  };
  // The two barriers of a collective, which an abort releases (std::barrier cannot be interrupted): every
  // sender's buffer posted (its completion opens the reading phase: all ranks read the others' buffers until each
  // calls done_reading), then every reader done. A rank that an abort releases, at either, throws — but only once
  // no rank is still reading, so no sender frees a buffer another rank is copying from.
  void arrive_posted() { arrive(true); }
  void arrive_read() { arrive(false); }
  void arrive(bool opens_reading);
  void done_reading();
  void wait_for_no_readers();
  void abort(const std::string& reason);

  int size_;
  InProcessTransport transport_;
  std::vector<Posted> posted_;
  std::mutex mutex_;
  std::condition_variable wake_;
  int arrived_ = 0, readers_ = 0;
  uint64_t round_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace dsv4::parallel
