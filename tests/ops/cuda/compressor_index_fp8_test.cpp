// The fused compressor step writing FP8 index keys (IndexKeyDtype::kFp8, 132 B for head_dim 128) against the CPU
// compressor + RMSNorm + RoPE with write_index_keys_cpu on the bf16 image. A translation unit of its own:
// cache/index_key_format.h and cache/kv_entry_format.h both define f32_to_e4m3_rne. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cache/index_key_format.h"
#include "compressor_problem.h"
#include "core/dtype.h"
#include "ops/cuda/device.h"

namespace dsv4::ops::cuda {
namespace {

using testing::CompressorCase;
using testing::CompressorEntry;
using testing::CompressorProblem;
using testing::CompressorSnapshot;

using testing::CudaCompressor;

TEST_F(CudaCompressor, CsaIndexFp8) {
  CompressorCase c;
  c.ratio = 4;
  c.head_dim = 128;
  c.rope_dim = 64;
  c.overlap = true;
  c.format = CompressorEntryFormat::kFp8Index;
  c.starts = testing::flash_starts();
  c.steps = testing::flash_steps();
  c.seed = 21;
  CompressorProblem problem(c);
  auto write = [&](const PagedGroupView& h, const CompressorEntry& e) {
    const int32_t block = h.block_table[e.row * h.block_table_stride + e.w / h.entries_per_block];
    if (block < 0) return;
    IndexKeyPagedLayout layout;
    layout.dtype = IndexKeyDtype::kFp8;
    layout.head_dim = c.head_dim;
    layout.entries_per_block = static_cast<int32_t>(h.entries_per_block);
    layout.layer_slot = static_cast<int32_t>(h.layer_index);
    layout.block_bytes = h.block_bytes;
    layout.page_bytes = h.page_bytes;
    layout.max_blocks_per_page = h.max_blocks_per_page;
    std::vector<uint16_t> key(e.values.size());
    for (size_t i = 0; i < key.size(); ++i) key[i] = f32_to_bf16(e.values[i]);
    const int64_t slot = int64_t{block} * h.entries_per_block + e.w % h.entries_per_block;
    write_index_keys_cpu(layout, key.data(), &slot, 1, h.arena);
  };
  CompressorProblem::GpuRun gpu(problem, -1);
  CompressorProblem::CpuRun cpu(problem, write);
  size_t written = 0;
  for (size_t s = 0; s < problem.num_steps(); ++s) {
    ASSERT_EQ(gpu.step(s), cudaSuccess) << "step " << s;
    written += cpu.step(s).size() * static_cast<size_t>(c.head_dim + 4);
    const CompressorSnapshot actual = gpu.snapshot();
    const CompressorSnapshot& expected = cpu.snapshot();
    EXPECT_TRUE(actual.state == expected.state) << "step " << s << ": state bytes differ";
    size_t differing = 0;
    for (size_t i = 0; i < actual.history.size(); ++i) differing += actual.history[i] != expected.history[i];
    EXPECT_LE(differing, std::max<size_t>(4, written / 1000)) << "step " << s;
    std::printf("  step %zu: %zu of %zu written bytes differ\n", s, differing, written);
  }
  EXPECT_GT(written, 0u);
}

}  // namespace
}  // namespace dsv4::ops::cuda
