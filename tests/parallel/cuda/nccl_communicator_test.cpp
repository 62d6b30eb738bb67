// The NCCL transport (parallel/nccl_communicator.h) against the definition (all_to_all_rounds.h, as the in-process
// one is tested in tests/parallel/communicator_test.cpp): rank d receives, from every rank s in order, exactly the
// run s addressed to d, zero-sized runs included, over several rounds; and the counts exchange. One rank per
// visible device (up to 4), each driven from its own thread; with one GPU it is the single-rank group (the run
// to itself). Skips without a GPU.
#include "parallel/nccl_communicator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "all_to_all_rounds.h"

namespace dsv4::parallel {
namespace {

TEST(NcclCommunicator, AllToAllDeliversEveryRunInSourceOrder) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
  const int n = std::min(devices, 4);
  std::vector<int> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[i] = i;
  auto comms = NcclCommunicator::for_devices(ids);
  const testing::RoundSizes sizes = testing::random_round_sizes(n, 3, 5000, 17);
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
        errors[rank] = testing::check_all_to_all_rounds(comm, rank, sizes, comm.stream());
      } catch (const std::exception& error) {
        errors[rank] = error.what();
      }
    });
  for (std::thread& thread : threads) thread.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << n << " ranks, rank " << r;
}

}  // namespace
}  // namespace dsv4::parallel
