// Ranks of one process on ONE GPU, one thread each, exchanging device memory: the device twin of InProcessGroup
// (parallel/communicator.h). It exists to test the device expert-parallel sublayer with several ranks where only
// one GPU is lent — NCCL refuses two ranks of a communicator on one device — and is not a transport between GPUs
// (that is NcclCommunicator). Same contract as NcclCommunicator's all_to_all_v: the buffers are device memory of
// the current GPU (exchange_counts: host counts). A collective waits for the rank's stream before publishing its
// send buffer (the kernels that write it may still be running), copies each run addressed to this rank with
// cudaMemcpyAsync on the rank's stream, and waits for those copies before the closing barrier, so the receive
// buffer is complete when the call returns.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "parallel/communicator.h"

namespace dsv4::parallel {

// One stream per rank (rank r runs its kernels and copies on streams[r]); every stream of the current device.
// Throws dsv4::Error for no stream.
std::unique_ptr<InProcessGroup> make_device_in_process_group(std::vector<cudaStream_t> streams);

}  // namespace dsv4::parallel
