#include "parallel/communicator.h"

#include <cstring>
#include <string>
#include <utility>

#include "core/error.h"

namespace dsv4::parallel {

std::vector<int64_t> Communicator::exchange_counts(std::span<const int64_t> send_counts) {
  const int n = size();
  DSV4_CHECK(static_cast<int>(send_counts.size()) == n,
             "exchange_counts: " + std::to_string(send_counts.size()) + " counts for " + std::to_string(n) + " ranks");
  std::vector<int64_t> received(static_cast<size_t>(n));
  const std::vector<int64_t> bytes(static_cast<size_t>(n), static_cast<int64_t>(sizeof(int64_t)));
  all_to_all_v(send_counts.data(), bytes, received.data(), bytes);
  return received;
}

class InProcessGroup::Member final : public Communicator {
 public:
  Member(InProcessGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size_; }
  void abort(const std::string& reason) override {
    group_.abort("expert-parallel rank " + std::to_string(rank_) + " aborted the group: " + reason);
  }

  void all_to_all_v(const void* send, std::span<const int64_t> send_bytes, void* recv,
                    std::span<const int64_t> recv_bytes) override {
    const int n = group_.size_;
    DSV4_CHECK(static_cast<int>(send_bytes.size()) == n && static_cast<int>(recv_bytes.size()) == n,
               "all_to_all_v: sizes for " + std::to_string(send_bytes.size()) + " / " +
                   std::to_string(recv_bytes.size()) + " ranks in a group of " + std::to_string(n));
    Posted& mine = group_.posted_[static_cast<size_t>(rank_)];
    mine.send = static_cast<const uint8_t*>(send);
    mine.offsets.assign(static_cast<size_t>(n) + 1, 0);
    for (int d = 0; d < n; ++d) {
      DSV4_CHECK(send_bytes[d] >= 0 && recv_bytes[d] >= 0, "all_to_all_v: a negative size");
      mine.offsets[d + 1] = mine.offsets[d] + send_bytes[d];
    }
    const InProcessTransport& transport = group_.transport_;
    // A transport failure (a device error) on this rank aborts the group: the others throw instead of waiting.
    auto guarded = [&](auto&& step) {
      try {
        step();
      } catch (const std::exception& error) {
        group_.abort("expert-parallel rank " + std::to_string(rank_) + " failed to move its bytes: " + error.what());
        throw;
      }
    };
    if (transport.before_post) guarded([&] { transport.before_post(rank_); });
    group_.arrive_posted();  // every sender's buffer and sizes are posted
    // This rank reads the others' buffers until finish(). Left by an exception instead (a transport failure,
    // which aborted the group), it also waits until no other rank reads this rank's buffers before they go.
    struct ReadingPhase {
      InProcessGroup& group;
      bool open = true;
      void finish() {
        if (open) group.done_reading();
        open = false;
      }
      ~ReadingPhase() {
        if (!open) return;
        finish();
        group.wait_for_no_readers();
      }
    } reading{group_};
    auto* out = static_cast<uint8_t*>(recv);
    int64_t at = 0;
    for (int s = 0; s < n; ++s) {
      const Posted& source = group_.posted_[static_cast<size_t>(s)];
      const int64_t bytes = source.offsets[rank_ + 1] - source.offsets[rank_];
      // A mismatch is the caller's bug on one side; every rank still reaches the second barrier before throwing,
      // so the others are not left waiting on it.
      if (bytes != recv_bytes[s]) {
        if (transport.after_copies) guarded([&] { transport.after_copies(rank_); });  // issued copies finish first
        reading.finish();
        group_.arrive_read();
        throw Error("all_to_all_v: rank " + std::to_string(s) + " sends " + std::to_string(bytes) + " bytes to rank " +
                    std::to_string(rank_) + ", which expects " + std::to_string(recv_bytes[s]));
      }
      if (bytes > 0) {
        const uint8_t* from = source.send + source.offsets[rank_];
        if (transport.copy) guarded([&] { transport.copy(rank_, out + at, from, static_cast<size_t>(bytes)); });
        else std::memcpy(out + at, from, static_cast<size_t>(bytes));
      }
      at += bytes;
    }
    if (transport.after_copies) guarded([&] { transport.after_copies(rank_); });
    reading.finish();
    group_.arrive_read();  // every reader is done with every sender's buffer
  }

 private:
  InProcessGroup& group_;
  int rank_;
};

void InProcessGroup::arrive(bool opens_reading) {
  std::unique_lock lock(mutex_);
  auto fail = [&] {
    wake_.wait(lock, [&] { return readers_ == 0; });  // no rank copies from this one's buffers any more
    throw Error(abort_reason_);
  };
  if (aborted_) fail();
  const uint64_t round = round_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++round_;
    if (opens_reading) readers_ = size_;
    wake_.notify_all();
    return;
  }
  wake_.wait(lock, [&] { return aborted_ || round_ != round; });
  if (round_ == round) fail();  // released by an abort, not by the last arrival
}

void InProcessGroup::wait_for_no_readers() {
  std::unique_lock lock(mutex_);
  wake_.wait(lock, [&] { return readers_ == 0; });
}

void InProcessGroup::done_reading() {
  {
    std::lock_guard lock(mutex_);
    --readers_;
  }
  wake_.notify_all();
}

void InProcessGroup::abort(const std::string& reason) {
  {
    std::lock_guard lock(mutex_);
    if (aborted_) return;
    aborted_ = true;
    abort_reason_ = reason;
  }
  wake_.notify_all();
}

InProcessGroup::InProcessGroup(int size, InProcessTransport transport)
    : size_(size), transport_(std::move(transport)), posted_(static_cast<size_t>(size > 0 ? size : 1)) {
  DSV4_CHECK(size >= 1, "a group needs at least one rank, got " + std::to_string(size));
}

std::unique_ptr<Communicator> InProcessGroup::communicator(int rank) {
  DSV4_CHECK(rank >= 0 && rank < size_, "rank " + std::to_string(rank) + " is outside a group of " + std::to_string(size_));
  return std::make_unique<Member>(*this, rank);
}

}  // namespace dsv4::parallel
