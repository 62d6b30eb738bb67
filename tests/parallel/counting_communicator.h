// A rank's transport that counts its collectives and what it received from the other ranks: the expert-parallel
// model tests' proof that rows really crossed ranks (a model ignoring its communicator would match the reference
// too). Wraps any transport (in-process, the device in-process group, NCCL) and forwards everything.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "parallel/communicator.h"

namespace dsv4::testing {

class CountingCommunicator final : public parallel::Communicator {
 public:
  explicit CountingCommunicator(std::unique_ptr<parallel::Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  // exchange_counts is the base class's, which runs through all_to_all_v below (so it counts too).
  void all_to_all_v(const void* send, std::span<const int64_t> send_bytes, void* recv,
                    std::span<const int64_t> recv_bytes) override {
    for (int s = 0; s < size(); ++s)
      if (s != rank()) bytes_from_others += recv_bytes[static_cast<size_t>(s)];
    ++collectives;
    inner_->all_to_all_v(send, send_bytes, recv, recv_bytes);
  }
  void synchronize() override { inner_->synchronize(); }
  void abort(const std::string& reason) override { inner_->abort(reason); }
  int64_t collectives = 0, bytes_from_others = 0;

 private:
  std::unique_ptr<parallel::Communicator> inner_;
};

}  // namespace dsv4::testing
