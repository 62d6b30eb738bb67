// The device in-process group (parallel/device_in_process_group.h) against the definition, as the NCCL transport is
// tested (tests/parallel/cuda/nccl_communicator_test.cpp): 1-4 ranks on device 0, each on its own thread and
// stream. Each round, rank s fills its send buffer with a kernel-free but stream-ordered write (cudaMemcpyAsync on
// its stream, still running when the collective starts) and rank d must receive, from every s in order, exactly the
// run s addressed to it, zero-sized runs included; the counts exchange of host vectors. Skips without a GPU.
#include "parallel/device_in_process_group.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace dsv4::parallel {
namespace {

uint8_t payload(int round, int s, int d, int64_t i) { return static_cast<uint8_t>(round * 31 + s * 7 + d * 13 + i); }

TEST(DeviceInProcessGroup, AllToAllDeliversEveryRunInSourceOrder) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  for (const int n : {1, 2, 4}) {
    std::vector<cudaStream_t> streams(static_cast<size_t>(n));
    for (auto& stream : streams) ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const std::unique_ptr<InProcessGroup> group = make_device_in_process_group(streams);
    std::mt19937 rng(static_cast<uint32_t>(23 + n));
    const int rounds = 3;
    std::vector<std::vector<std::vector<int64_t>>> sizes(rounds);
    for (auto& round : sizes) {
      round.assign(n, std::vector<int64_t>(n));
      for (auto& row : round)
        for (int64_t& b : row) b = rng() % 3 == 0 ? 0 : static_cast<int64_t>(1 + rng() % 70000);
    }
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < n; ++rank)
      threads.emplace_back([&, rank] {
        const std::unique_ptr<Communicator> comm = group->communicator(rank);
        const cudaStream_t stream = streams[static_cast<size_t>(rank)];
        try {
          for (int round = 0; round < rounds; ++round) {
            std::vector<int64_t> send_bytes(n);
            std::vector<uint8_t> send;
            for (int d = 0; d < n; ++d) {
              send_bytes[d] = sizes[round][rank][d];
              for (int64_t i = 0; i < send_bytes[d]; ++i) send.push_back(payload(round, rank, d, i));
            }
            const std::vector<int64_t> recv_bytes = comm->exchange_counts(send_bytes);
            std::vector<uint8_t> expected;
            for (int s = 0; s < n; ++s) {
              if (recv_bytes[s] != sizes[round][s][rank]) errors[rank] = "counts differ";
              for (int64_t i = 0; i < sizes[round][s][rank]; ++i) expected.push_back(payload(round, s, rank, i));
            }
            uint8_t *d_send = nullptr, *d_recv = nullptr;
            cudaMalloc(&d_send, std::max<size_t>(1, send.size()));
            cudaMalloc(&d_recv, std::max<size_t>(1, expected.size()));
            cudaMemsetAsync(d_recv, 0xee, std::max<size_t>(1, expected.size()), stream);
            // Enqueued, not waited for: the group must wait for the sender's stream itself.
            cudaMemcpyAsync(d_send, send.data(), send.size(), cudaMemcpyHostToDevice, stream);
            comm->all_to_all_v(d_send, send_bytes, d_recv, recv_bytes);
            std::vector<uint8_t> recv(expected.size());
            cudaMemcpyAsync(recv.data(), d_recv, recv.size(), cudaMemcpyDeviceToHost, stream);
            cudaStreamSynchronize(stream);
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
    for (auto& stream : streams) cudaStreamDestroy(stream);
  }
}

}  // namespace
}  // namespace dsv4::parallel
