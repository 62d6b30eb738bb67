// The NCCL transport (parallel/nccl_communicator.h) against the definition, as the in-process one is tested
// (tests/parallel/communicator_test.cpp): rank d receives, from every rank s in order, exactly the run s
// addressed to d, zero-sized runs included, over several rounds; and the counts exchange. One rank per visible
// device (up to 4), each driven from its own thread; with one GPU it is the single-rank group (the run to
// itself). Skips without a GPU.
#include "parallel/nccl_communicator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace dsv4::parallel {
namespace {

uint8_t payload(int round, int s, int d, int64_t i) { return static_cast<uint8_t>(round * 29 + s * 5 + d * 11 + i); }

TEST(NcclCommunicator, AllToAllDeliversEveryRunInSourceOrder) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  const int n = std::min(devices, 4);
  std::vector<int> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[i] = i;
  auto comms = NcclCommunicator::for_devices(ids);
  std::mt19937 rng(17);
  const int rounds = 3;
  std::vector<std::vector<std::vector<int64_t>>> sizes(rounds);
  for (auto& round : sizes) {
    round.assign(n, std::vector<int64_t>(n));
    for (auto& row : round)
      for (int64_t& b : row) b = rng() % 3 == 0 ? 0 : static_cast<int64_t>(1 + rng() % 5000);
  }
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < n; ++rank)
    threads.emplace_back([&, rank] {
      NcclCommunicator& comm = *comms[rank];
      if (cudaSetDevice(ids[rank]) != cudaSuccess) {
        errors[rank] = "cudaSetDevice";
        return;
      }
      try {
        for (int round = 0; round < rounds; ++round) {
          std::vector<int64_t> send_bytes(n);
          std::vector<uint8_t> send;
          for (int d = 0; d < n; ++d) {
            send_bytes[d] = sizes[round][rank][d];
            for (int64_t i = 0; i < send_bytes[d]; ++i) send.push_back(payload(round, rank, d, i));
          }
          const std::vector<int64_t> recv_bytes = comm.exchange_counts(send_bytes);
          std::vector<uint8_t> expected;
          for (int s = 0; s < n; ++s) {
            if (recv_bytes[s] != sizes[round][s][rank]) errors[rank] = "counts differ";
            for (int64_t i = 0; i < sizes[round][s][rank]; ++i) expected.push_back(payload(round, s, rank, i));
          }
          uint8_t *d_send = nullptr, *d_recv = nullptr;
          cudaMalloc(&d_send, std::max<size_t>(1, send.size()));
          cudaMalloc(&d_recv, std::max<size_t>(1, expected.size()));
          cudaMemcpy(d_send, send.data(), send.size(), cudaMemcpyHostToDevice);
          cudaMemset(d_recv, 0xee, std::max<size_t>(1, expected.size()));
          comm.all_to_all_v(d_send, send_bytes, d_recv, recv_bytes);
          cudaStreamSynchronize(comm.stream());
          std::vector<uint8_t> recv(expected.size());
          cudaMemcpy(recv.data(), d_recv, recv.size(), cudaMemcpyDeviceToHost);
          cudaFree(d_send);
          cudaFree(d_recv);
          if (recv != expected) errors[rank] = "round " + std::to_string(round) + ": the received bytes differ";
        }
      } catch (const std::exception& error) {
        errors[rank] = error.what();
      }
    });
  for (std::thread& thread : threads) thread.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << n << " ranks, rank " << r;
}

}  // namespace
}  // namespace dsv4::parallel
