// The check both device transports of the expert-parallel all-to-all run (NcclCommunicator, the device in-process
// group): over several rounds of random per-pair sizes (zero-sized runs included), the counts exchange gives every
// rank what the others send it, and rank d receives, from every rank s in order, exactly the run s addressed to
// d. The send buffer is written on the rank's stream and not waited for, so the transport must order after it.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "parallel/communicator.h"

namespace dsv4::parallel::testing {

// sizes[round][s][d]: the bytes rank s sends rank d in that round; about a third are zero.
using RoundSizes = std::vector<std::vector<std::vector<int64_t>>>;
inline RoundSizes random_round_sizes(int ranks, int rounds, int64_t max_bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  RoundSizes sizes(static_cast<size_t>(rounds));
  for (auto& round : sizes) {
    round.assign(static_cast<size_t>(ranks), std::vector<int64_t>(static_cast<size_t>(ranks)));
    for (auto& row : round)
      for (int64_t& b : row) b = rng() % 3 == 0 ? 0 : static_cast<int64_t>(1 + rng() % max_bytes);
  }
  return sizes;
}

inline uint8_t round_payload(int round, int s, int d, int64_t i) {
  return static_cast<uint8_t>(round * 31 + s * 7 + d * 13 + i);
}

// Runs every round on `rank` (its thread, its device current, its stream); "" when every byte arrived, else what
// went wrong.
inline std::string check_all_to_all_rounds(Communicator& comm, int rank, const RoundSizes& sizes,
                                           cudaStream_t stream) {
  const int n = comm.size();
  std::string error;
  for (int round = 0; round < static_cast<int>(sizes.size()); ++round) {
    std::vector<int64_t> send_bytes(static_cast<size_t>(n));
    std::vector<uint8_t> send;
    for (int d = 0; d < n; ++d) {
      send_bytes[d] = sizes[round][rank][d];
      for (int64_t i = 0; i < send_bytes[d]; ++i) send.push_back(round_payload(round, rank, d, i));
    }
    const std::vector<int64_t> recv_bytes = comm.exchange_counts(send_bytes);
    std::vector<uint8_t> expected;
    for (int s = 0; s < n; ++s) {
      if (error.empty() && recv_bytes[s] != sizes[round][s][rank])
        error = "round " + std::to_string(round) + ": counts differ";
      for (int64_t i = 0; i < sizes[round][s][rank]; ++i) expected.push_back(round_payload(round, s, rank, i));
    }
    uint8_t *d_send = nullptr, *d_recv = nullptr;
    cudaMalloc(&d_send, std::max<size_t>(1, send.size()));
    cudaMalloc(&d_recv, std::max<size_t>(1, expected.size()));
    cudaMemsetAsync(d_recv, 0xee, std::max<size_t>(1, expected.size()), stream);
    cudaMemcpyAsync(d_send, send.data(), send.size(), cudaMemcpyHostToDevice, stream);  // not waited for
    comm.all_to_all_v(d_send, send_bytes, d_recv, recv_bytes);
    std::vector<uint8_t> recv(expected.size());
    cudaMemcpyAsync(recv.data(), d_recv, recv.size(), cudaMemcpyDeviceToHost, stream);
    const cudaError_t status = cudaStreamSynchronize(stream);
    cudaFree(d_send);
    cudaFree(d_recv);
    // The first error is kept, and every round still runs: the other ranks wait in its collectives.
    if (error.empty() && status != cudaSuccess)
      error = "round " + std::to_string(round) + ": " + cudaGetErrorString(status);
    if (error.empty() && recv != expected) error = "round " + std::to_string(round) + ": the received bytes differ";
  }
  return error;
}

}  // namespace dsv4::parallel::testing
