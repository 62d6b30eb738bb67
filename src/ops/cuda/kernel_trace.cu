// Host code only (a .cu so that the ops/cuda glob builds it with the CUDA toolkit's include path for cupti_*.h).
#include "ops/cuda/kernel_trace.h"

#include <cupti_activity.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace dsv4::ops::cuda {
namespace {

// The CUPTI entry points the trace uses, resolved from the library at run time.
struct Cupti {
  void* library = nullptr;
  CUptiResult (*activity_enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*activity_disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
};

struct KernelRecord {
  uint64_t start, end;
  uint32_t stream;
  int32_t grid_x;
  std::string name;
};

// CUPTI calls the buffer callbacks from its own thread; one trace per process.
std::mutex records_mutex;
std::vector<KernelRecord> records;
Cupti cupti;
constexpr size_t kBufferBytes = 8 << 20;
constexpr size_t kBufferAlign = 8;  // CUPTI's ACTIVITY_RECORD_ALIGNMENT

std::string demangled(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* readable = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && readable ? readable : name;
  std::free(readable);
  return out;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid_bytes) {
  std::vector<KernelRecord> batch;
  CUpti_Activity* record = nullptr;
  while (cupti.next_record(buffer, valid_bytes, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    // The record version of the cupti_activity.h this is built with (CUDA 13), the one its CUPTI writes.
    const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    batch.push_back({kernel->start, kernel->end, kernel->streamId, kernel->gridX, demangled(kernel->name)});
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(records_mutex);
  records.insert(records.end(), std::make_move_iterator(batch.begin()), std::make_move_iterator(batch.end()));
}

template <typename F>
void resolve(F& function, const char* symbol) {
  function = reinterpret_cast<F>(dlsym(cupti.library, symbol));
  DSV4_CHECK(function != nullptr, std::string("DSV4_KERNEL_TRACE: CUPTI has no ") + symbol);
}

void load_cupti() {
  if (cupti.library != nullptr) return;
  const char* override_path = std::getenv("DSV4_CUPTI_LIBRARY");
  std::string tried;
  for (const char* name : {override_path, "libcupti.so", "libcupti.so.13", "libcupti.so.12"}) {
    if (name == nullptr || *name == '\0') continue;
    cupti.library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (cupti.library != nullptr) break;
    tried += std::string(tried.empty() ? "" : ", ") + name;
  }
  DSV4_CHECK(cupti.library != nullptr,
             "DSV4_KERNEL_TRACE: cannot load CUPTI (tried " + tried + "; set DSV4_CUPTI_LIBRARY to its path)");
  resolve(cupti.activity_enable, "cuptiActivityEnable");
  resolve(cupti.activity_disable, "cuptiActivityDisable");
  resolve(cupti.register_callbacks, "cuptiActivityRegisterCallbacks");
  resolve(cupti.flush_all, "cuptiActivityFlushAll");
  resolve(cupti.next_record, "cuptiActivityGetNextRecord");
}

// The CSV field of a kernel name: quoted, quotes doubled.
std::string csv_quoted(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace

KernelTrace::KernelTrace(std::string path) : path_(std::move(path)) {
  load_cupti();
  DSV4_CHECK(cupti.register_callbacks(buffer_requested, buffer_completed) == CUPTI_SUCCESS,
             "DSV4_KERNEL_TRACE: cuptiActivityRegisterCallbacks failed");
  // CONCURRENT_KERNEL, not KERNEL: the latter serialises every launch.
  DSV4_CHECK(cupti.activity_enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) == CUPTI_SUCCESS,
             "DSV4_KERNEL_TRACE: cuptiActivityEnable(CONCURRENT_KERNEL) failed");
}

KernelTrace::~KernelTrace() {
  cupti.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  cupti.activity_disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  std::vector<KernelRecord> sorted;
  {
    std::lock_guard<std::mutex> lock(records_mutex);
    sorted.swap(records);
  }
  std::sort(sorted.begin(), sorted.end(), [](const KernelRecord& a, const KernelRecord& b) { return a.start < b.start; });
  std::FILE* file = std::fopen(path_.c_str(), "w");
  if (file == nullptr) {
    std::fprintf(stderr, "DSV4_KERNEL_TRACE: cannot write %s\n", path_.c_str());
    return;
  }
  std::fprintf(file, "Start (ns),Duration (ns),GrdX,Strm,Name\n");
  for (const KernelRecord& r : sorted)
    std::fprintf(file, "%llu,%llu,%d,%u,%s\n", static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end - r.start), r.grid_x, r.stream, csv_quoted(r.name).c_str());
  std::fclose(file);
  std::fprintf(stderr, "DSV4_KERNEL_TRACE: %zu kernels written to %s\n", sorted.size(), path_.c_str());
}

std::unique_ptr<KernelTrace> KernelTrace::start_from_env() {
  const char* path = std::getenv("DSV4_KERNEL_TRACE");
  if (path == nullptr || *path == '\0') return nullptr;
  return std::make_unique<KernelTrace>(path);
}

}  // namespace dsv4::ops::cuda
