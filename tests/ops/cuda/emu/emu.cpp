#include "emu.h"
#include <atomic>
#include <memory>
thread_local Dim3 threadIdx;
Dim3 blockIdx, gridDim;
namespace {
constexpr int kT = 256;
std::barrier<>* cta_bar;
std::barrier<>* warp_bar[8];
double xbuf[8][32];
std::barrier<>* start_bar;
std::barrier<>* end_bar;
const std::function<void()>* current = nullptr;
bool stop = false;
std::vector<std::thread> pool;
void worker(int t) {
  threadIdx.x = t;
  for (;;) {
    start_bar->arrive_and_wait();
    if (stop) return;
    (*current)();
    end_bar->arrive_and_wait();
  }
}
struct Init {
  Init() {
    cta_bar = new std::barrier<>(kT);
    for (auto& b : warp_bar) b = new std::barrier<>(32);
    start_bar = new std::barrier<>(kT + 1);
    end_bar = new std::barrier<>(kT + 1);
    for (int t = 0; t < kT; ++t) pool.emplace_back(worker, t);
  }
  ~Init() { stop = true; start_bar->arrive_and_wait(); for (auto& th : pool) th.join(); }
} init;
}  // namespace
void __syncthreads() { cta_bar->arrive_and_wait(); }
double emu_shfl(double v, int x, int up, int mode) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  xbuf[warp][lane] = v;
  warp_bar[warp]->arrive_and_wait();
  double r = mode == 0 ? xbuf[warp][lane ^ x] : (lane >= up ? xbuf[warp][lane - up] : v);
  warp_bar[warp]->arrive_and_wait();
  return r;
}
void emu_launch(int blocks, const std::function<void()>& body) {
  gridDim.x = blocks;
  current = &body;
  for (int b = 0; b < blocks; ++b) {
    blockIdx.x = b;
    start_bar->arrive_and_wait();
    end_bar->arrive_and_wait();
  }
}
#include "ops/cuda/device.h"
namespace dsv4::ops::cuda {
std::vector<DeviceInfo> list_devices() { DeviceInfo d; d.name = "emulated"; d.multiprocessors = 132; return {d}; }
}
