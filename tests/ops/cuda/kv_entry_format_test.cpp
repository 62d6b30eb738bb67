// The CUDA K=V writer / quantizer (cache/kv_entry_format_cuda.h) against its CPU twin: the whole arena, bit for
// bit, for both formats, over values from the e4m3 subnormal range to large magnitudes, with and without the
// window rule (row_end). Skips without a GPU.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "cache/kv_entry_format.h"
#include "cache/kv_entry_format_cuda.h"
#include "device_problem.h"
#include "ops/cuda/device.h"

namespace dsv4::testing {
namespace {

TEST(CudaKvEntryWriter, MatchesCpuTwinBitwise) {
  if (ops::cuda::list_devices().empty()) GTEST_SKIP() << "no CUDA device";
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16}) {
    for (const bool fake_quantize : {true, false})
    for (const bool windowed : {false, true}) {
      const int32_t per_block = 64;
      const int64_t region = kv_region_bytes(format, per_block), block_bytes = 3 * region;  // layer 2 of 3
      const int64_t page_bytes = 2 * block_bytes + 4096;
      const int64_t blocks = 9, rows = 3, n = 301;  // 301 vectors: the last warp block is partial
      std::vector<uint8_t> host_arena(static_cast<size_t>((blocks / 2 + 1) * page_bytes), 0x5a);
      std::vector<int32_t> table(static_cast<size_t>(rows * 3));
      for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>((i * 4) % blocks);
      table[4] = -1;  // an unallocated block: its entries are skipped
      std::mt19937 rng(static_cast<uint32_t>(17 + static_cast<int>(format) * 2 + fake_quantize));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<uint16_t> kv(static_cast<size_t>(n * kKvHeadDim));
      for (int64_t i = 0; i < n; ++i) {
        const float magnitude = std::exp2(std::uniform_real_distribution<float>(-16.0f, 12.0f)(rng));
        for (int c = 0; c < kKvHeadDim; ++c) kv[i * kKvHeadDim + c] = f32_to_bf16(magnitude * normal(rng));
      }
      std::vector<int32_t> entries(static_cast<size_t>(n)), row_of(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        row_of[i] = static_cast<int32_t>(i % rows);
        entries[i] = static_cast<int32_t>((i / rows * 5) % (3 * per_block));  // distinct within a row
      }
      // The window rule: row r keeps entries ≥ row_end[r] − 64 (entries run to 191).
      const std::vector<int32_t> row_end = {150, 100, 192};
      uint8_t* d_arena = to_device(host_arena);
      int32_t* d_row_end = to_device(row_end);
      int32_t* d_table = to_device(table);
      int32_t* d_entries = to_device(entries);
      int32_t* d_rows = to_device(row_of);
      uint16_t* d_kv = to_device(kv);
      const PagedKvPool host_pool{host_arena.data(), page_bytes, 2, block_bytes, 2 * region, per_block, table.data(), 3};
      PagedKvPool device_pool = host_pool;
      device_pool.arena = d_arena;
      device_pool.block_table = d_table;
      KvWriteParams host_params{n, format, fake_quantize, host_pool, entries.data(), row_of.data()};
      KvWriteParams device_params{n, format, fake_quantize, device_pool, d_entries, d_rows};
      if (windowed) {
        host_params.row_end = row_end.data();
        device_params.row_end = d_row_end;
        host_params.window_size = device_params.window_size = 64;
      }
      write_kv_entries(host_params, kv.data());
      ASSERT_EQ(cuda::write_kv_entries(device_params, d_kv, nullptr), cudaSuccess);
      std::vector<uint8_t> device_arena(host_arena.size());
      DSV4_CUDA_OK(cudaMemcpy(device_arena.data(), d_arena, device_arena.size(), cudaMemcpyDeviceToHost));
      for (void* p : {static_cast<void*>(d_arena), static_cast<void*>(d_table), static_cast<void*>(d_entries),
                      static_cast<void*>(d_rows), static_cast<void*>(d_kv), static_cast<void*>(d_row_end)})
        cudaFree(p);
      size_t mismatches = 0, first = 0;
      for (size_t b = 0; b < host_arena.size(); ++b)
        if (host_arena[b] != device_arena[b] && mismatches++ == 0) first = b;
      EXPECT_EQ(mismatches, 0u) << "format " << static_cast<int>(format) << " fake " << fake_quantize << " windowed "
                                << windowed << ", first differing byte " << first;
    }
  }
}

}  // namespace
}  // namespace dsv4::testing
