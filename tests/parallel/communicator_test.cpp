// The in-process transport of the expert-parallel all-to-alls (parallel/communicator.h) against the definition:
// rank d receives, from every rank s in order, exactly the run s addressed to d. Random sizes (zeros included) on
// 1-5 ranks, repeated collectives on one group, the counts exchange, a size mismatch that fails the rank that
// sees it with a message naming both ranks, without leaving the others blocked, and an abort that releases them.
#include "parallel/communicator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "parallel/deadline_communicator.h"

namespace dsv4::parallel {
namespace {

// Runs body(rank, communicator) on one thread per rank; returns each rank's exception text ("" if none).
template <typename Body>
std::vector<std::string> on_ranks(InProcessGroup& group, Body body) {
  std::vector<std::string> errors(static_cast<size_t>(group.size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < group.size(); ++r)
    threads.emplace_back([&, r] {
      const std::unique_ptr<Communicator> comm = group.communicator(r);
      try {
        body(r, *comm);
      } catch (const std::exception& error) {
        errors[r] = error.what();
      }
    });
  for (std::thread& thread : threads) thread.join();
  return errors;
}

// The byte rank s sends to rank d at position i of that run, for round `round`.
uint8_t payload(int round, int s, int d, int64_t i) { return static_cast<uint8_t>(round * 31 + s * 7 + d * 13 + i); }

TEST(InProcessGroup, AllToAllDeliversEveryRunInSourceOrder) {
  for (const int n : {1, 2, 3, 5}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    // sizes[round][s][d]: bytes s sends d; a third of them zero.
    const int rounds = 4;
    std::vector<std::vector<std::vector<int64_t>>> sizes(rounds);
    for (auto& round : sizes) {
      round.assign(n, std::vector<int64_t>(n));
      for (auto& row : round)
        for (int64_t& b : row) b = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % 300);
    }
    InProcessGroup group(n);
    const auto errors = on_ranks(group, [&](int rank, Communicator& comm) {
      ASSERT_EQ(comm.rank(), rank);
      ASSERT_EQ(comm.size(), n);
      for (int round = 0; round < rounds; ++round) {
        std::vector<int64_t> send_bytes(n), recv_bytes(n);
        std::vector<uint8_t> send;
        for (int d = 0; d < n; ++d) {
          send_bytes[d] = sizes[round][rank][d];
          for (int64_t i = 0; i < send_bytes[d]; ++i) send.push_back(payload(round, rank, d, i));
        }
        // The sizes travel first, as the MoE's counts do.
        recv_bytes = comm.exchange_counts(send_bytes);
        std::vector<uint8_t> expected;
        for (int s = 0; s < n; ++s) {
          ASSERT_EQ(recv_bytes[s], sizes[round][s][rank]);
          for (int64_t i = 0; i < recv_bytes[s]; ++i) expected.push_back(payload(round, s, rank, i));
        }
        std::vector<uint8_t> recv(expected.size(), 0xee);
        comm.all_to_all_v(send.data(), send_bytes, recv.data(), recv_bytes);
        ASSERT_EQ(recv, expected) << "round " << round << ", rank " << rank;
      }
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << n << " ranks, rank " << r;
  }
}

TEST(InProcessGroup, ASizeMismatchFailsTheReceiverAndReleasesTheOthers) {
  InProcessGroup group(3);
  std::vector<std::string> failures(3);
  const auto errors = on_ranks(group, [&](int rank, Communicator& comm) {
    // Rank 0 sends 8 bytes to rank 2, which expects 4; every other pair agrees on 4.
    std::vector<int64_t> send_bytes(3, 4), recv_bytes(3, 4);
    if (rank == 0) send_bytes[2] = 8;
    std::vector<uint8_t> send(16, static_cast<uint8_t>(rank)), recv(12, 0);
    try {
      comm.all_to_all_v(send.data(), send_bytes, recv.data(), recv_bytes);
    } catch (const Error& error) {
      failures[rank] = error.what();
    }
    // Every rank left the failed collective, so the group goes on.
    const std::vector<int64_t> counts = comm.exchange_counts(std::vector<int64_t>{rank, rank, rank});
    EXPECT_EQ(counts, (std::vector<int64_t>{0, 1, 2}));
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_EQ(failures[0], "");
  EXPECT_EQ(failures[1], "");
  EXPECT_NE(failures[2].find("rank 0 sends 8 bytes to rank 2, which expects 4"), std::string::npos) << failures[2];
}

// A rank that fails aborts the group instead of calling the next collective: the ranks already waiting in it, and
// every later collective on any rank, throw an error naming the aborting rank and its reason (no rank hangs).
TEST(InProcessGroup, AnAbortReleasesTheRanksWaitingInACollective) {
  InProcessGroup group(3);
  const auto errors = on_ranks(group, [&](int rank, Communicator& comm) {
    // One collective that succeeds, then rank 1 aborts while the others enter the next one.
    EXPECT_EQ(comm.exchange_counts(std::vector<int64_t>{rank, rank, rank}), (std::vector<int64_t>{0, 1, 2}));
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the others are waiting by now
      comm.abort("injected failure");
      comm.exchange_counts(std::vector<int64_t>{1, 1, 1});  // throws: aborted
    }
    comm.exchange_counts(std::vector<int64_t>{rank, rank, rank});
  });
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(errors[r].find("expert-parallel rank 1 aborted the group: injected failure"), std::string::npos)
        << "rank " << r << ": " << errors[r];
}

// A group's transport (InProcessTransport): its copy moves every byte between ranks, before_post runs before a rank
// publishes and after_copies once its copies are issued, on every rank and collective; a copy that throws aborts
// the group, so the other ranks throw too instead of waiting for the failed one.
TEST(InProcessGroup, ATransportMovesTheBytesAndItsFailureAbortsTheGroup) {
  std::atomic<int64_t> copied{0};
  std::atomic<int> posts{0}, finishes{0};
  InProcessTransport counting;
  counting.copy = [&](int, void* dst, const void* src, size_t bytes) {
    std::memcpy(dst, src, bytes);
    copied += static_cast<int64_t>(bytes);
  };
  counting.before_post = [&](int) { ++posts; };
  counting.after_copies = [&](int) { ++finishes; };
  {
    InProcessGroup group(3, counting);
    const auto errors = on_ranks(group, [&](int rank, Communicator& comm) {
      EXPECT_EQ(comm.exchange_counts(std::vector<int64_t>{rank, rank, rank}), (std::vector<int64_t>{0, 1, 2}));
    });
    for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  }
  EXPECT_EQ(copied.load(), 3 * 3 * static_cast<int64_t>(sizeof(int64_t)));  // every run, the own one included
  EXPECT_EQ(posts.load(), 3);
  EXPECT_EQ(finishes.load(), 3);

  InProcessTransport failing;
  failing.copy = [](int rank, void* dst, const void* src, size_t bytes) {
    if (rank == 2) throw Error("injected copy failure");
    std::memcpy(dst, src, bytes);
  };
  InProcessGroup group(3, failing);
  const auto errors = on_ranks(group, [&](int rank, Communicator& comm) {
    comm.exchange_counts(std::vector<int64_t>{rank, rank, rank});
  });
  EXPECT_NE(errors[2].find("injected copy failure"), std::string::npos) << errors[2];
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("rank 2 failed to move its bytes: injected copy failure"), std::string::npos)
        << "rank " << r << ": " << errors[r];
}

TEST(InProcessGroup, RejectsBadSizesAndRanks) {
  EXPECT_THROW(InProcessGroup(0), Error);
  InProcessGroup group(2);
  EXPECT_THROW(group.communicator(2), Error);
  EXPECT_THROW(group.communicator(-1), Error);
  InProcessGroup single(1);
  auto comm = single.communicator(0);
  EXPECT_THROW(comm->exchange_counts(std::vector<int64_t>{1, 2}), Error);
}

// A peer that never joins (dead or hung): the waiting rank's watchdog aborts the group after the deadline, so the
// collective throws an error that says why instead of waiting for ever; later collectives throw at once.
TEST(DeadlineCommunicator, ACollectiveAPeerNeverJoinsThrowsAfterTheDeadline) {
  InProcessGroup group(2);
  DeadlineCommunicator rank0(group.communicator(0), std::chrono::milliseconds(200));
  const std::unique_ptr<Communicator> rank1 = group.communicator(1);  // never calls a collective
  const std::vector<int64_t> counts = {3, 5};
  const auto start = std::chrono::steady_clock::now();
  try {
    rank0.exchange_counts(counts);
    ADD_FAILURE() << "the collective returned without its peer";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--dist-timeout"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("rank 0"), std::string::npos) << error.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 0.19);
  EXPECT_LT(waited, 10.0);
  EXPECT_THROW(rank0.exchange_counts(counts), Error);
  EXPECT_THROW(rank1->exchange_counts(counts), Error);  // the whole group is aborted
}

// Only time inside a collective counts: idle gaps longer than the deadline between collectives do not fire, and
// collectives that complete in time move their bytes as the bare transport does.
TEST(DeadlineCommunicator, CollectivesWithinTheDeadlineDoNotFire) {
  const int n = 3;
  InProcessGroup group(n);
  std::vector<std::unique_ptr<DeadlineCommunicator>> ranks;
  for (int r = 0; r < n; ++r)
    ranks.push_back(std::make_unique<DeadlineCommunicator>(group.communicator(r), std::chrono::milliseconds(500)));
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        for (int round = 0; round < 40; ++round) {
          std::vector<int64_t> counts(n);
          for (int d = 0; d < n; ++d) counts[d] = 10 * r + d + round;
          const std::vector<int64_t> received = ranks[r]->exchange_counts(counts);
          for (int s = 0; s < n; ++s)
            if (received[s] != 10 * s + r + round) throw Error("round " + std::to_string(round) + ": wrong count");
          ranks[r]->synchronize();
          if (round % 20 == 19) std::this_thread::sleep_for(std::chrono::milliseconds(600));  // idle, not waiting
        }
      } catch (const std::exception& error) {
        errors[r] = error.what();
      }
    });
  for (std::thread& thread : threads) thread.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(DeadlineCommunicator, RejectsNoTransportAndNoDeadline) {
  InProcessGroup group(1);
  EXPECT_THROW(DeadlineCommunicator(nullptr, std::chrono::milliseconds(10)), Error);
  EXPECT_THROW(DeadlineCommunicator(group.communicator(0), std::chrono::milliseconds(0)), Error);
}

}  // namespace
}  // namespace dsv4::parallel
