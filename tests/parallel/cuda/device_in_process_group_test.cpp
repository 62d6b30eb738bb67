// The device in-process group (parallel/device_in_process_group.h) against the definition, the same check as the
// NCCL transport's (all_to_all_rounds.h): 1, 2 and 4 ranks on device 0, each on its own thread and stream, the
// send buffers still being written on the senders' streams when each collective starts. Skips without a GPU.
#include "parallel/device_in_process_group.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "all_to_all_rounds.h"

namespace dsv4::parallel {
namespace {

TEST(DeviceInProcessGroup, AllToAllDeliversEveryRunInSourceOrder) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  for (const int n : {1, 2, 4}) {
    std::vector<cudaStream_t> streams(static_cast<size_t>(n));
    for (auto& stream : streams) ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const std::unique_ptr<InProcessGroup> group = make_device_in_process_group(streams);
    const testing::RoundSizes sizes = testing::random_round_sizes(n, 3, 70000, static_cast<uint32_t>(23 + n));
    std::vector<std::string> errors(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < n; ++rank)
      threads.emplace_back([&, rank] {
        const std::unique_ptr<Communicator> comm = group->communicator(rank);
        try {
          errors[rank] = testing::check_all_to_all_rounds(*comm, rank, sizes, streams[static_cast<size_t>(rank)]);
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
