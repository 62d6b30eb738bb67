// Command-line flags that generate, serve and bench throughput share for their data-parallel ranks.
#pragma once
#include <CLI/CLI.hpp>

namespace dsv4::cli {

// --dist-timeout (SGLang's flag): how long a rank's collective may wait for the others before the group aborts
// (parallel/deadline_communicator.h).
inline void add_dist_timeout_option(CLI::App* command, double& seconds) {
  command
      ->add_option("--dist-timeout", seconds,
                   "seconds a rank may wait in a collective for the others before the group aborts and its "
                   "requests fail (a rank died or hangs; SGLang's flag)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
}

// --data-parallel-backend (vLLM's flag): where the data-parallel ranks run (cli/rank_processes.h).
inline void add_data_parallel_backend_option(CLI::App* command, std::string& backend) {
  command
      ->add_option("--data-parallel-backend", backend,
                   "mp: a process per rank (rank r on cuda:base+r when visible); threads: every rank in this "
                   "process; auto: mp on CUDA where it can run, threads on the CPU")
      ->check(CLI::IsMember({"auto", "mp", "threads"}))
      ->capture_default_str();
}

}  // namespace dsv4::cli
