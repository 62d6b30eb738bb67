// The main K=V entry formats (cache/kv_entry_format.h): the e4m3 rounding and UE8M0 scale of the quantizer
// against brute force, the 584-byte FP8 layout and its page padding, and the paged addressing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "cache/cache_spec.h"
#include "cache/kv_entry_format.h"
#include "core/dtype.h"

namespace dsv4 {
namespace {

// Nearest finite e4m3 code by exhaustive search, ties to the even code (even mantissa).
uint8_t nearest_e4m3(float x) {
  uint8_t best = 0;
  double best_error = INFINITY;
  for (int code = 0; code < 256; ++code) {
    const float v = f8e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(v) || (std::signbit(v) != std::signbit(x))) continue;
    const double error = std::fabs(double(v) - double(x));
    if (error < best_error || (error == best_error && (code & 1) == 0)) {
      best_error = error;
      best = static_cast<uint8_t>(code);
    }
  }
  return best;
}

TEST(KvEntryFormat, E4m3RoundingMatchesBruteForce) {
  // Every code is a fixed point, every midpoint between neighbours goes to the even one, random values to the
  // nearest.
  for (int code = 0; code < 256; ++code) {
    const float v = f8e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(v)) continue;
    if (v == 0.0f) {
      EXPECT_EQ(f32_to_e4m3_rne(v) & 0x7f, 0);
      continue;
    }
    EXPECT_EQ(f32_to_e4m3_rne(v), code) << code;
    if ((code & 0x7f) < 0x7e) {
      const float next = f8e4m3_to_f32(static_cast<uint8_t>(code + 1));
      const float mid = 0.5f * (v + next);
      EXPECT_EQ(f32_to_e4m3_rne(mid), nearest_e4m3(mid)) << "midpoint above " << code;
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-12.0f, 8.8f);
  for (int i = 0; i < 20000; ++i) {
    const float x = (rng() & 1 ? -1.0f : 1.0f) * std::exp2(exponent(rng));
    const float clamped = std::clamp(x, -448.0f, 448.0f);
    ASSERT_EQ(f32_to_e4m3_rne(clamped), nearest_e4m3(clamped)) << x;
  }
}

TEST(KvEntryFormat, ScaleIsCeilPowerOfTwo) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> exponent(-20.0f, 20.0f);
  for (int i = 0; i < 20000; ++i) {
    const float amax = std::exp2(exponent(rng));
    const float ratio = std::max(amax, 1e-4f) / 448.0f;
    const int expected = static_cast<int>(std::ceil(std::log2(static_cast<double>(ratio))));
    ASSERT_EQ(static_cast<int>(kv_scale_byte(amax)) - 127, expected) << amax;
  }
  EXPECT_EQ(kv_scale_byte(448.0f), 127);        // exactly 1
  EXPECT_EQ(kv_scale_byte(0.0f), kv_scale_byte(1e-4f));  // the floor
}

TEST(KvEntryFormat, SizesAndPagePadding) {
  EXPECT_EQ(kv_entry_bytes(KvEntryFormat::kFp8), 584);
  EXPECT_EQ(kv_entry_bytes(KvEntryFormat::kFp8), main_entry_bytes(512, 64, KvStorage::kFp8));
  EXPECT_EQ(kv_entry_bytes(KvEntryFormat::kBf16), main_entry_bytes(512, 64, KvStorage::kBf16));
  EXPECT_EQ(kv_region_bytes(KvEntryFormat::kFp8, 64), 65 * 576);  // 37376 rounded up
  EXPECT_EQ(kv_region_bytes(KvEntryFormat::kFp8, 2), 3 * 576);    // 1168 rounded up
  EXPECT_EQ(kv_region_bytes(KvEntryFormat::kFp8, 72), 73 * 576);  // 72·584 = 73·576 exactly
  EXPECT_EQ(kv_region_bytes(KvEntryFormat::kBf16, 64), 65536);
}

TEST(KvEntryFormat, QuantizeDequantize) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<uint16_t> kv(kKvHeadDim);
    const float magnitude = std::exp2(std::uniform_real_distribution<float>(-10.0f, 10.0f)(rng));
    for (auto& v : kv) v = f32_to_bf16(magnitude * normal(rng));
    uint8_t fp8[kKvFp8DataBytes + kKvFp8ScaleBytes];
    uint16_t bf16[kKvHeadDim];
    const KvEntryAddress fp8_entry{fp8, fp8 + kKvFp8DataBytes};
    const KvEntryAddress bf16_entry{reinterpret_cast<uint8_t*>(bf16), nullptr};
    kv_quantize_entry(KvEntryFormat::kFp8, kv.data(), fp8_entry, true);
    kv_quantize_entry(KvEntryFormat::kBf16, kv.data(), bf16_entry, true);
    std::vector<float> from_fp8(kKvHeadDim), from_bf16(kKvHeadDim);
    kv_dequantize_entry(KvEntryFormat::kFp8, fp8_entry, from_fp8.data());
    kv_dequantize_entry(KvEntryFormat::kBf16, bf16_entry, from_bf16.data());
    // The BF16 cache's fake-quantized image is the FP8 entry, bit for bit.
    ASSERT_EQ(from_fp8, from_bf16);
    EXPECT_EQ(fp8[kKvFp8DataBytes + kKvNumScales], 0) << "pad byte";
    for (int b = 0; b < kKvNumScales; ++b) {
      float amax = 0;
      for (int i = 0; i < 64; ++i) amax = std::max(amax, std::fabs(bf16_to_f32(kv[b * 64 + i])));
      const float scale = std::ldexp(1.0f, fp8[kKvFp8DataBytes + b] - 127);
      ASSERT_LE(amax, 448.0f * scale);
      ASSERT_GT(amax, 224.0f * scale * (amax > 1e-4f ? 1.0f : 0.0f));
      for (int i = 0; i < 64; ++i) {
        const int c = b * 64 + i;
        const float x = bf16_to_f32(kv[c]);
        // Half a unit in the last place of a 3-bit mantissa, or half the subnormal step 2^-9 · scale.
        ASSERT_LE(std::fabs(from_fp8[c] - x), std::max(std::fabs(x) / 16.0f, scale * std::ldexp(1.0f, -10)))
            << c;
        ASSERT_EQ(from_fp8[c], std::ldexp(f8e4m3_to_f32(nearest_e4m3(std::ldexp(x, 127 - fp8[kKvFp8DataBytes + b]))),
                                          fp8[kKvFp8DataBytes + b] - 127));
      }
    }
    for (int c = kKvNopeDim; c < kKvHeadDim; ++c) ASSERT_EQ(from_fp8[c], bf16_to_f32(kv[c])) << "rope " << c;
    // Without fake quantization a BF16 entry is the input.
    kv_quantize_entry(KvEntryFormat::kBf16, kv.data(), bf16_entry, false);
    ASSERT_EQ(std::vector<uint16_t>(bf16, bf16 + kKvHeadDim), kv);
  }
}

TEST(KvEntryFormat, PagedWritesLandInTheirOwnRegion) {
  // Two layers per block, 3 blocks per page with a tail; write every entry of layer 1 of 5 shuffled blocks and
  // check the bytes outside layer 1's regions are untouched and each entry reads back.
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16}) {
    const int32_t per_block = 64;
    const int64_t region = kv_region_bytes(format, per_block), block_bytes = 2 * region;
    const int64_t page_bytes = 3 * block_bytes + 1000;
    std::vector<uint8_t> arena(static_cast<size_t>(3 * page_bytes), 0xa5);
    const std::vector<int32_t> table = {7, 0, 5, 4, 2};
    const PagedKvPool pool{arena.data(), page_bytes, 3, block_bytes, region, per_block, table.data(), 5};
    const int64_t n = 5 * per_block;
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<uint16_t> kv(static_cast<size_t>(n * kKvHeadDim));
    for (auto& v : kv) v = f32_to_bf16(normal(rng));
    std::vector<int32_t> entries(static_cast<size_t>(n)), rows(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n; ++i) entries[i] = static_cast<int32_t>((i * 37) % n);  // scattered order
    write_kv_entries({n, format, true, pool, entries.data(), rows.data()}, kv.data());
    std::set<int64_t> inside;
    for (const int32_t block : table) {
      const int64_t start = (block / 3) * page_bytes + (block % 3) * block_bytes + region;
      const int64_t used = format == KvEntryFormat::kFp8 ? per_block * kKvFp8EntryBytes : region;
      for (int64_t b = 0; b < used; ++b) inside.insert(start + b);
    }
    for (int64_t b = 0; b < static_cast<int64_t>(arena.size()); ++b)
      if (!inside.count(b)) {
        ASSERT_EQ(arena[b], 0xa5) << "byte " << b << " outside the written regions";
      }
    for (int64_t i = 0; i < n; ++i) {
      std::vector<float> read(kKvHeadDim), expected(kKvHeadDim);
      kv_dequantize_entry(format, kv_entry_address(pool, format, 0, entries[i]), read.data());
      uint8_t scratch[kKvBf16EntryBytes + 8];
      const KvEntryAddress local{scratch, scratch + kKvBf16EntryBytes};
      kv_quantize_entry(format, &kv[i * kKvHeadDim], local, true);
      kv_dequantize_entry(format, local, expected.data());
      ASSERT_EQ(read, expected) << i;
    }
  }
}

// The window rule (KvWriteParams::row_end): an entry below row_end[row] − window_size is left alone, every other
// one is written. Two rows of 128 entries, ends 100 and 128, window 32.
TEST(KvEntryFormat, WindowWriterSkipsEntriesBeforeTheWindow) {
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16}) {
    const int32_t per_block = 64;
    const int64_t region = kv_region_bytes(format, per_block), block_bytes = region;
    std::vector<uint8_t> arena(static_cast<size_t>(4 * block_bytes), 0xa5);
    const std::vector<int32_t> table = {3, 1, 0, 2};  // row 0: blocks 3, 1; row 1: blocks 0, 2
    const PagedKvPool pool{arena.data(), block_bytes, 1, block_bytes, 0, per_block, table.data(), 2};
    const int64_t n = 2 * 128;
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0.0f, 1.5f);
    std::vector<uint16_t> kv(static_cast<size_t>(n * kKvHeadDim));
    for (auto& v : kv) v = f32_to_bf16(normal(rng));
    std::vector<int32_t> entries(static_cast<size_t>(n)), rows(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      rows[i] = static_cast<int32_t>(i / 128);
      entries[i] = static_cast<int32_t>(i % 128);
    }
    const std::vector<int32_t> row_end = {100, 128};
    KvWriteParams params{n, format, false, pool, entries.data(), rows.data()};
    params.row_end = row_end.data();
    params.window_size = 32;
    write_kv_entries(params, kv.data());
    for (int64_t i = 0; i < n; ++i) {
      const KvEntryAddress address = kv_entry_address(pool, format, rows[i], entries[i]);
      const bool wanted = entries[i] >= row_end[rows[i]] - 32;
      const int64_t data_bytes = format == KvEntryFormat::kFp8 ? kKvFp8DataBytes : kKvBf16EntryBytes;
      const bool untouched = std::all_of(address.data, address.data + data_bytes, [](uint8_t b) { return b == 0xa5; });
      EXPECT_EQ(untouched, !wanted) << "row " << rows[i] << " entry " << entries[i];
      if (wanted) {
        std::vector<float> read(kKvHeadDim), expected(kKvHeadDim);
        kv_dequantize_entry(format, address, read.data());
        uint8_t scratch[kKvBf16EntryBytes + 8];
        kv_quantize_entry(format, &kv[i * kKvHeadDim], {scratch, scratch + kKvBf16EntryBytes}, false);
        kv_dequantize_entry(format, {scratch, scratch + kKvBf16EntryBytes}, expected.data());
        ASSERT_EQ(read, expected) << i;
      }
    }
  }
}

}  // namespace
}  // namespace dsv4
