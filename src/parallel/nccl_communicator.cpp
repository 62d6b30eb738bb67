#include "parallel/nccl_communicator.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace dsv4::parallel {

namespace {

void check_nccl(ncclResult_t result, const char* what) {
  if (result != ncclSuccess) throw Error(std::string(what) + ": " + ncclGetErrorString(result));
}

void check_cuda(cudaError_t result, const char* what) {
  if (result != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(result));
}

}  // namespace

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int size, int rank, cudaStream_t stream, bool owns_stream)
    : comm_(comm), size_(size), rank_(rank), stream_(stream), owns_stream_(owns_stream) {
  check_cuda(cudaMalloc(&staging_, 2 * static_cast<size_t>(size) * sizeof(int64_t)), "NCCL count staging");
}

NcclCommunicator::NcclCommunicator(const ncclUniqueId& id, int size, int rank, cudaStream_t stream)
    : size_(size), rank_(rank), stream_(stream) {
  DSV4_CHECK(size >= 1 && rank >= 0 && rank < size,
             "NCCL rank " + std::to_string(rank) + " of " + std::to_string(size) + " does not exist");
  check_nccl(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
  check_cuda(cudaMalloc(&staging_, 2 * static_cast<size_t>(size) * sizeof(int64_t)), "NCCL count staging");
}

std::string NcclCommunicator::new_unique_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof id.internal);
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::join(const std::string& unique_id, int size, int rank) {
  ncclUniqueId id;
  DSV4_CHECK(unique_id.size() == sizeof id.internal,
             "an NCCL unique id of " + std::to_string(unique_id.size()) + " bytes (expected " +
                 std::to_string(sizeof id.internal) + ")");
  std::copy(unique_id.begin(), unique_id.end(), id.internal);
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  try {
    auto communicator = std::make_unique<NcclCommunicator>(id, size, rank, stream);
    communicator->owns_stream_ = true;
    return communicator;
  } catch (...) {
    cudaStreamDestroy(stream);
    throw;
  }
}

std::vector<std::unique_ptr<NcclCommunicator>> NcclCommunicator::for_devices(const std::vector<int>& devices) {
  DSV4_CHECK(!devices.empty(), "NcclCommunicator::for_devices needs at least one device");
  const int n = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(devices.size());
  check_nccl(ncclCommInitAll(comms.data(), n, devices.data()), "ncclCommInitAll");
  std::vector<std::unique_ptr<NcclCommunicator>> result;
  for (int r = 0; r < n; ++r) {
    check_cuda(cudaSetDevice(devices[r]), "cudaSetDevice");
    cudaStream_t stream = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    result.push_back(std::unique_ptr<NcclCommunicator>(new NcclCommunicator(comms[r], n, r, stream, true)));
  }
  return result;
}

NcclCommunicator::~NcclCommunicator() {
  if (staging_) cudaFree(staging_);
  if (comm_) ncclCommDestroy(comm_);
  if (owns_stream_ && stream_) cudaStreamDestroy(stream_);
}

void NcclCommunicator::abort(const std::string& reason) {
  if (!abort_reason_.empty()) return;
  abort_reason_ = "NCCL rank " + std::to_string(rank_) + " aborted: " + reason;
  if (comm_) ncclCommAbort(comm_);
  comm_ = nullptr;
}

void NcclCommunicator::all_to_all_v(const void* send, std::span<const int64_t> send_bytes, void* recv,
                                    std::span<const int64_t> recv_bytes) {
  if (!abort_reason_.empty()) throw Error(abort_reason_);
  DSV4_CHECK(static_cast<int>(send_bytes.size()) == size_ && static_cast<int>(recv_bytes.size()) == size_,
             "all_to_all_v: sizes for " + std::to_string(send_bytes.size()) + " / " +
                 std::to_string(recv_bytes.size()) + " ranks in a group of " + std::to_string(size_));
  const auto* out = static_cast<const uint8_t*>(send);
  auto* in = static_cast<uint8_t*>(recv);
  // One group: every send and receive of this rank is posted before NCCL starts any (no ordering deadlock
  // between peers); zero-byte pairs are skipped on both sides alike, since both know the size.
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  int64_t send_at = 0, recv_at = 0;
  for (int peer = 0; peer < size_; ++peer) {
    DSV4_CHECK(send_bytes[peer] >= 0 && recv_bytes[peer] >= 0, "all_to_all_v: a negative size");
    if (send_bytes[peer] > 0)
      check_nccl(ncclSend(out + send_at, static_cast<size_t>(send_bytes[peer]), ncclUint8, peer, comm_, stream_),
                 "ncclSend");
    if (recv_bytes[peer] > 0)
      check_nccl(ncclRecv(in + recv_at, static_cast<size_t>(recv_bytes[peer]), ncclUint8, peer, comm_, stream_),
                 "ncclRecv");
    send_at += send_bytes[peer];
    recv_at += recv_bytes[peer];
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
}

std::vector<int64_t> NcclCommunicator::exchange_counts(std::span<const int64_t> send_counts) {
  if (!abort_reason_.empty()) throw Error(abort_reason_);
  DSV4_CHECK(static_cast<int>(send_counts.size()) == size_,
             "exchange_counts: " + std::to_string(send_counts.size()) + " counts for " + std::to_string(size_) +
                 " ranks");
  const size_t bytes = static_cast<size_t>(size_) * sizeof(int64_t);
  check_cuda(cudaMemcpyAsync(staging_, send_counts.data(), bytes, cudaMemcpyHostToDevice, stream_), "count upload");
  const std::vector<int64_t> each(static_cast<size_t>(size_), static_cast<int64_t>(sizeof(int64_t)));
  all_to_all_v(staging_, each, staging_ + size_, each);
  std::vector<int64_t> received(static_cast<size_t>(size_));
  check_cuda(cudaMemcpyAsync(received.data(), staging_ + size_, bytes, cudaMemcpyDeviceToHost, stream_),
             "count download");
  check_cuda(cudaStreamSynchronize(stream_), "count exchange");
  return received;
}

void NcclCommunicator::synchronize() {
  if (!abort_reason_.empty()) throw Error(abort_reason_);
  check_cuda(cudaStreamSynchronize(stream_), "all-to-all");
}

}  // namespace dsv4::parallel
