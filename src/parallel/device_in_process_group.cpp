#include "parallel/device_in_process_group.h"

#include <string>
#include <utility>

#include "core/error.h"

namespace dsv4::parallel {
namespace {

void check(cudaError_t status, const char* what, int rank) {
  if (status != cudaSuccess)
    throw Error(std::string(what) + " failed on rank " + std::to_string(rank) + ": " + cudaGetErrorString(status));
}

}  // namespace

std::unique_ptr<InProcessGroup> make_device_in_process_group(std::vector<cudaStream_t> streams) {
  DSV4_CHECK(!streams.empty(), "a device in-process group needs at least one rank's stream");
  auto shared = std::make_shared<const std::vector<cudaStream_t>>(std::move(streams));
  InProcessTransport transport;
  transport.before_post = [shared](int rank) {
    check(cudaStreamSynchronize((*shared)[static_cast<size_t>(rank)]), "waiting for the send buffer", rank);
  };
  // cudaMemcpyDefault: the device buffers of all_to_all_v and the host counts of exchange_counts alike (UVA).
  transport.copy = [shared](int rank, void* dst, const void* src, size_t bytes) {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (*shared)[static_cast<size_t>(rank)]),
          "cudaMemcpyAsync of a run", rank);
  };
  transport.after_copies = [shared](int rank) {
    check(cudaStreamSynchronize((*shared)[static_cast<size_t>(rank)]), "waiting for the copies", rank);
  };
  const int size = static_cast<int>(shared->size());
  return std::make_unique<InProcessGroup>(size, std::move(transport));
}

}  // namespace dsv4::parallel
