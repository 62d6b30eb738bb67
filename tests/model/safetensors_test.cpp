// Tests for src/model/safetensors.{h,cpp}: round trips, bf16 conversion, shard sets, and every validation
// error (each checked for the fact its message must name).
#include "model/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

// A fresh directory under the test temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::path(::testing::TempDir()) / ("dsv4_st_" + std::string(test->name()) + "_" +
                                              std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::vector<uint8_t> random_bytes(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> out(count);
  for (auto& b : out) b = static_cast<uint8_t>(byte(rng));
  // Never all zero: force a nonzero byte.
  if (!out.empty()) out[0] |= 0x01;
  return out;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void write_text(const std::string& path, const std::string& text) {
  write_file(path, std::vector<uint8_t>(text.begin(), text.end()));
}

// A file made of a raw header text and `data_size` data bytes.
void write_raw_safetensors(const std::string& path, const std::string& header, size_t data_size) {
  std::vector<uint8_t> bytes(8);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(n >> (8 * i));
  bytes.insert(bytes.end(), header.begin(), header.end());
  const auto data = random_bytes(data_size, 7);
  bytes.insert(bytes.end(), data.begin(), data.end());
  write_file(path, bytes);
}

// The message of the dsv4::Error that `fn` throws; fails the test if it throws nothing or something else.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-dsv4::Error exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

std::string parse_error(const std::string& header, uint64_t data_size) {
  return error_of([&] { parse_safetensors_header(header, data_size, "hdr.safetensors"); });
}

TensorToWrite make_tensor(const std::string& name, DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  return TensorToWrite{name, dtype, shape,
                       random_bytes(static_cast<size_t>(numel) * dtype_size(dtype), seed)};
}

// ---------------------------------------------------------------------------------------------------------

TEST(TensorInfo, Numel) {
  TensorInfo info;
  EXPECT_EQ(info.numel(), 1);  // scalar
  info.shape = {3, 4, 5};
  EXPECT_EQ(info.numel(), 60);
  info.shape = {3, 0, 5};
  EXPECT_EQ(info.numel(), 0);
}

TEST(Safetensors, RoundTripSeveralDtypes) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  std::vector<TensorToWrite> tensors = {
      make_tensor("a.f32", DType::kF32, {3, 5}, 1),     make_tensor("b.bf16", DType::kBF16, {7, 2, 3}, 2),
      make_tensor("c.f16", DType::kF16, {9}, 3),        make_tensor("d.i64", DType::kI64, {2, 2}, 4),
      make_tensor("e.i32", DType::kI32, {5}, 5),        make_tensor("f.fp8", DType::kF8E4M3, {3, 11}, 6),
      make_tensor("g.e8m0", DType::kF8E8M0, {13}, 7),   make_tensor("h.i8", DType::kI8, {17}, 8),
      make_tensor("i.u8", DType::kU8, {1, 19}, 9),      make_tensor("j.scalar", DType::kF32, {}, 10),
      make_tensor("k.empty", DType::kBF16, {0, 4}, 11),
  };
  write_safetensors(path, tensors, {{"format", "pt"}, {"note", "round trip"}});

  // 8 + N is a multiple of 8.
  const auto raw = read_file(path);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | raw[i];
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(raw[8], '{');

  SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), tensors.size());
  for (size_t i = 1; i < file.tensors().size(); ++i)
    EXPECT_LE(file.tensors()[i - 1].data_begin, file.tensors()[i].data_begin);
  for (const auto& t : tensors) {
    const TensorInfo* info = file.find(t.name);
    ASSERT_NE(info, nullptr) << t.name;
    EXPECT_EQ(info->dtype, t.dtype) << t.name;
    EXPECT_EQ(info->shape, t.shape) << t.name;
    ASSERT_EQ(info->data_end - info->data_begin, t.bytes.size()) << t.name;
    if (!t.bytes.empty()) {
      EXPECT_EQ(std::memcmp(file.data(*info), t.bytes.data(), t.bytes.size()), 0) << t.name;
    }
  }
  EXPECT_EQ(file.find("missing"), nullptr);

  // Data is contiguous in the given order.
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const TensorInfo* info = file.find(t.name);
    EXPECT_EQ(info->data_begin, offset) << t.name;
    offset += t.bytes.size();
  }

  SafetensorsArchive archive(path);
  std::vector<std::string> expected_names;
  for (const auto& t : tensors) expected_names.push_back(t.name);
  std::sort(expected_names.begin(), expected_names.end());
  EXPECT_EQ(archive.names(), expected_names);
  const auto i32 = archive.read_f32("e.i32");
  ASSERT_EQ(i32.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    int32_t v;
    std::memcpy(&v, tensors[4].bytes.data() + 4 * i, 4);
    EXPECT_EQ(i32[i], static_cast<float>(v));
  }
  EXPECT_TRUE(archive.read_f32("k.empty").empty());
  EXPECT_EQ(archive.read_f32("j.scalar").size(), 1u);

  // No temp files are left behind.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, RoundTripWithoutMetadataAndOverwrite) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  write_safetensors(path, {make_tensor("w", DType::kF32, {4}, 21)}, {});
  write_safetensors(path, {make_tensor("v", DType::kU8, {3}, 22)}, {});  // replaces the first
  SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 1u);
  EXPECT_EQ(file.tensors()[0].name, "v");
}

TEST(Safetensors, Bf16ToF32Values) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::vector<float> values = {1.0f, -2.5f, 0.15625f, 3.0e38f, -1.0e-20f, 65504.0f, 0.0f, 1.0f / 3};
  std::vector<uint8_t> bytes(values.size() * 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = f32_to_bf16(values[i]);
    std::memcpy(bytes.data() + 2 * i, &bits, 2);
  }
  write_safetensors(path, {{"t", DType::kBF16, {2, 4}, bytes}});
  SafetensorsArchive archive(dir.path().string());  // a directory with model.safetensors
  const auto out = archive.read_f32("t");
  ASSERT_EQ(out.size(), values.size());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.5f);
  EXPECT_EQ(out[2], 0.15625f);
  EXPECT_EQ(out[6], 0.0f);
  for (size_t i = 0; i < values.size(); ++i) {
    // bf16 keeps 8 significant bits: relative error at most 2^-9.
    EXPECT_LE(std::fabs(out[i] - values[i]), std::fabs(values[i]) * (1.0f / 512)) << i;
  }
  // 1/3 in bf16 is exactly 0x3EAB -> 0.333984375.
  EXPECT_EQ(out[7], 0.333984375f);
}

TEST(Safetensors, ShardedArchiveWithIndex) {
  TempDir dir;
  write_safetensors(
      dir.file("model-00001-of-00002.safetensors"),
      {make_tensor("layers.0.w", DType::kBF16, {4, 8}, 31), make_tensor("layers.0.b", DType::kF32, {8}, 32)});
  write_safetensors(dir.file("model-00002-of-00002.safetensors"),
                    {make_tensor("layers.1.w", DType::kF8E4M3, {4, 8}, 33),
                     make_tensor("layers.1.s", DType::kF8E8M0, {4}, 34),
                     make_tensor("extra.unlisted", DType::kI32, {2}, 35)});
  write_text(dir.file("model.safetensors.index.json"),
             R"({"metadata": {"total_size": 100}, "weight_map": {
                  "layers.0.w": "model-00001-of-00002.safetensors",
                  "layers.0.b": "model-00001-of-00002.safetensors",
                  "layers.1.w": "model-00002-of-00002.safetensors",
                  "layers.1.s": "model-00002-of-00002.safetensors"}})");
  SafetensorsArchive archive(dir.path().string());
  EXPECT_EQ(archive.names(), (std::vector<std::string>{"extra.unlisted", "layers.0.b", "layers.0.w",
                                                       "layers.1.s", "layers.1.w"}));
  const auto* entry = archive.find("layers.1.w");
  ASSERT_NE(entry, nullptr);
  EXPECT_THAT(entry->file->path(), HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_EQ(entry->info->dtype, DType::kF8E4M3);
  EXPECT_EQ(archive.find("layers.0.w")->file->path(), archive.find("layers.0.b")->file->path());
  EXPECT_EQ(archive.find("nope"), nullptr);
  EXPECT_EQ(archive.read_f32("layers.0.w").size(), 32u);
  const auto scales = archive.read_f32("layers.1.s");
  ASSERT_EQ(scales.size(), 4u);
  const uint8_t* raw = entry->file->data(*archive.find("layers.1.s")->info);
  for (size_t i = 0; i < 4; ++i) {
    if (raw[i] == 0xff) {
      EXPECT_TRUE(std::isnan(scales[i]));
    } else {
      EXPECT_EQ(scales[i], std::ldexp(1.0f, static_cast<int>(raw[i]) - 127));
    }
  }

  EXPECT_THAT(error_of([&] { archive.read_f32("nope"); }), HasSubstr("'nope'"));
}

TEST(Safetensors, DirectoryWithSingleShardFile) {
  TempDir dir;
  write_safetensors(dir.file("weights.safetensors"), {make_tensor("w", DType::kF16, {3}, 41)});
  SafetensorsArchive archive(dir.path().string());
  EXPECT_EQ(archive.names(), std::vector<std::string>{"w"});
}

// ---------------------------------------------------------------------------------------------------------
// Error cases

TEST(SafetensorsErrors, TruncatedFileAtSeveralLengths) {
  TempDir dir;
  const std::string good = dir.file("good.safetensors");
  write_safetensors(good, {make_tensor("w", DType::kF32, {16}, 51), make_tensor("b", DType::kBF16, {8}, 52)});
  const auto bytes = read_file(good);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];

  const std::string cut = dir.file("cut.safetensors");
  const std::vector<size_t> lengths = {0,
                                       1,
                                       7,
                                       8,
                                       9,
                                       8 + static_cast<size_t>(n) / 2,
                                       8 + static_cast<size_t>(n) - 1,
                                       8 + static_cast<size_t>(n),
                                       8 + static_cast<size_t>(n) + 5,
                                       bytes.size() - 1};
  for (const size_t length : lengths) {
    write_file(cut, std::vector<uint8_t>(bytes.begin(), bytes.begin() + static_cast<long>(length)));
    const std::string msg = error_of([&] { SafetensorsFile file(cut); });
    EXPECT_THAT(msg, HasSubstr(cut)) << "length " << length;
    if (length < 8) {
      EXPECT_THAT(msg, HasSubstr("truncated")) << "length " << length;
      EXPECT_THAT(msg, HasSubstr(std::to_string(length) + " bytes")) << "length " << length;
    } else if (length < 8 + n) {
      EXPECT_THAT(msg, HasSubstr("truncated: header says " + std::to_string(n) + " bytes but file has " +
                                 std::to_string(length)));
    } else {
      // Header intact, data section short: the last tensor's end is out of bounds.
      EXPECT_THAT(msg, HasSubstr("past the data section")) << "length " << length;
    }
  }
}

TEST(SafetensorsErrors, HeaderLengthLargerThanFile) {
  TempDir dir;
  const std::string path = dir.file("big.safetensors");
  std::vector<uint8_t> bytes = {0x00, 0x10, 0, 0, 0, 0, 0, 0};  // N = 4096
  const std::string header = R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})";
  bytes.insert(bytes.end(), header.begin(), header.end());
  write_file(path, bytes);
  const std::string msg = error_of([&] { SafetensorsFile file(path); });
  EXPECT_THAT(msg, HasSubstr("header says 4096 bytes but file has " + std::to_string(bytes.size())));

  // N beyond the 100 MB limit (and beyond any file).
  std::vector<uint8_t> huge = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '{', '}'};
  write_file(path, huge);
  EXPECT_THAT(error_of([&] { SafetensorsFile file(path); }), HasSubstr("18446744073709551615"));
}

TEST(SafetensorsErrors, MissingFileAndDirectory) {
  TempDir dir;
  EXPECT_THAT(error_of([&] { SafetensorsFile file(dir.file("absent.safetensors")); }),
              HasSubstr("absent.safetensors"));
  EXPECT_THAT(error_of([&] { SafetensorsArchive archive(dir.file("absent")); }), HasSubstr("absent"));
  // An empty directory: nothing to open.
  EXPECT_THAT(error_of([&] { SafetensorsArchive archive(dir.path().string()); }),
              HasSubstr(dir.path().string()));
  // Two candidate files and no index or model.safetensors.
  write_safetensors(dir.file("a.safetensors"), {make_tensor("w", DType::kU8, {2}, 61)});
  write_safetensors(dir.file("b.safetensors"), {make_tensor("w", DType::kU8, {2}, 62)});
  const std::string msg = error_of([&] { SafetensorsArchive archive(dir.path().string()); });
  EXPECT_THAT(msg, HasSubstr("2 *.safetensors files"));
  EXPECT_THAT(msg, HasSubstr("a.safetensors"));
}

TEST(SafetensorsErrors, BadJson) {
  EXPECT_THAT(parse_error(R"({"a": {"dtype": "F32",)", 0), HasSubstr("not valid JSON"));
  EXPECT_THAT(parse_error("", 0), HasSubstr("hdr.safetensors"));
  EXPECT_THAT(parse_error("[1, 2]", 0), HasSubstr("must be a JSON object"));
  EXPECT_THAT(parse_error(std::string(100, '[') + std::string(100, ']'), 0), HasSubstr("nests deeper"));
  EXPECT_THAT(parse_error(R"({"a": 5})", 0), HasSubstr("'a'"));
  EXPECT_THAT(parse_error(R"({"__metadata__": {"k": 1}})", 0), HasSubstr("'k'"));
  EXPECT_THAT(parse_error(R"({"__metadata__": [1]})", 0), HasSubstr("__metadata__"));
  // Invalid UTF-8 in a name.
  EXPECT_THAT(parse_error("{\"\xff\": {}}", 0), HasSubstr("hdr.safetensors"));

  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_raw_safetensors(path, "{not json}", 0);
  const std::string msg = error_of([&] { SafetensorsFile file(path); });
  EXPECT_THAT(msg, HasSubstr(path));
  EXPECT_THAT(msg, HasSubstr("not valid JSON"));
}

TEST(SafetensorsErrors, MissingOrMistypedFields) {
  EXPECT_THAT(parse_error(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4),
              HasSubstr("missing \"dtype\""));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4),
              HasSubstr("missing \"shape\""));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": "F32", "shape": [1]}})", 4),
              HasSubstr("missing \"data_offsets\""));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": 3, "shape": [1], "data_offsets": [0, 4]}})", 4),
              HasSubstr("'w'"));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4),
              HasSubstr("shape[0]"));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})", 4),
              HasSubstr("1.5"));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}})", 4),
              HasSubstr("\"shape\" must be an array"));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})", 8),
              HasSubstr("an array of 3"));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})", 8),
              HasSubstr("-4"));
  EXPECT_THAT(parse_error(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})", 8),
              HasSubstr("begin 8 > end 4"));
  // A dimension past int64 and a product that overflows.
  EXPECT_THAT(
      parse_error(R"({"w": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 0]}})", 0),
      HasSubstr("18446744073709551615"));
  EXPECT_THAT(
      parse_error(R"({"w": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0),
      HasSubstr("overflows"));
  // Overflow in numel * dtype_size.
  EXPECT_THAT(
      parse_error(R"({"w": {"dtype": "I64", "shape": [4611686018427387904], "data_offsets": [0, 0]}})", 0),
      HasSubstr("'w'"));
}

TEST(SafetensorsErrors, ZeroDimensionWithHugeOthersIsEmpty) {
  const auto tensors = parse_safetensors_header(
      R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]}})", 0, "z");
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors[0].numel(), 0);
}

TEST(SafetensorsErrors, UnknownDtype) {
  const std::string msg =
      parse_error(R"({"weird.w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", 8);
  EXPECT_THAT(msg, HasSubstr("'weird.w'"));
  EXPECT_THAT(msg, HasSubstr("F64"));
  EXPECT_THAT(msg, HasSubstr("hdr.safetensors"));
}

TEST(SafetensorsErrors, ShapeTimesDtypeNotByteLength) {
  const std::string msg =
      parse_error(R"({"proj.w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 20]}})", 64);
  EXPECT_THAT(msg, HasSubstr("'proj.w'"));
  EXPECT_THAT(msg, HasSubstr("byte length 20"));
  EXPECT_THAT(msg, HasSubstr("12 elements x 2 bytes"));
}

TEST(SafetensorsErrors, OffsetsOutOfBounds) {
  const std::string msg =
      parse_error(R"({"tail": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})", 20);
  EXPECT_THAT(msg, HasSubstr("'tail'"));
  EXPECT_THAT(msg, HasSubstr("end 24"));
  EXPECT_THAT(msg, HasSubstr("20 bytes"));

  // Through a file: the data section is shorter than the header claims.
  TempDir dir;
  const std::string path = dir.file("oob.safetensors");
  write_raw_safetensors(path, R"({"tail": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 12);
  const std::string file_msg = error_of([&] { SafetensorsFile file(path); });
  EXPECT_THAT(file_msg, HasSubstr(path));
  EXPECT_THAT(file_msg, HasSubstr("'tail'"));
  EXPECT_THAT(file_msg, HasSubstr("(12 bytes)"));
}

TEST(SafetensorsErrors, OverlappingTensors) {
  const std::string msg = parse_error(R"({
      "first":  {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "second": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]}})",
                                      32);
  EXPECT_THAT(msg, HasSubstr("'first'"));
  EXPECT_THAT(msg, HasSubstr("'second'"));
  EXPECT_THAT(msg, HasSubstr("overlap"));
  // Same range twice.
  EXPECT_THAT(parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                              "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
                          4),
              HasSubstr("overlap"));
  // A tensor nested inside a larger one (caught though it does not overlap its sorted neighbour).
  EXPECT_THAT(parse_error(R"({"big": {"dtype": "U8", "shape": [10], "data_offsets": [0, 10]},
                              "mid": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]},
                              "end": {"dtype": "U8", "shape": [2], "data_offsets": [6, 8]}})",
                          10),
              HasSubstr("'big'"));
  // Zero-length tensors may sit anywhere, also inside others; adjacent tensors are fine.
  const auto ok = parse_safetensors_header(R"({
      "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "z": {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]},
      "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})",
                                           8, "ok");
  ASSERT_EQ(ok.size(), 3u);
  EXPECT_EQ(ok[0].name, "a");
  EXPECT_EQ(ok[1].name, "z");
  EXPECT_EQ(ok[2].name, "b");
}

TEST(SafetensorsErrors, IndexPointsAtMissingShard) {
  TempDir dir;
  write_safetensors(dir.file("shard-1.safetensors"), {make_tensor("a", DType::kF32, {2}, 71)});
  write_text(dir.file("model.safetensors.index.json"),
             R"({"weight_map": {"a": "shard-1.safetensors", "b": "shard-2.safetensors"}})");
  const std::string msg = error_of([&] { SafetensorsArchive archive(dir.path().string()); });
  EXPECT_THAT(msg, HasSubstr("shard-2.safetensors"));
  EXPECT_THAT(msg, HasSubstr("does not exist"));
}

TEST(SafetensorsErrors, IndexTensorMissingFromShard) {
  TempDir dir;
  write_safetensors(dir.file("shard-1.safetensors"), {make_tensor("a", DType::kF32, {2}, 81)});
  write_text(dir.file("model.safetensors.index.json"),
             R"({"weight_map": {"a": "shard-1.safetensors", "ghost.w": "shard-1.safetensors",
                                "ghost.b": "shard-1.safetensors"}})");
  const std::string msg = error_of([&] { SafetensorsArchive archive(dir.path().string()); });
  EXPECT_THAT(msg, HasSubstr("'ghost.w'"));
  EXPECT_THAT(msg, HasSubstr("'ghost.b'"));
  EXPECT_THAT(msg, HasSubstr("shard-1.safetensors"));
  EXPECT_THAT(msg, Not(HasSubstr("'a'")));
}

TEST(SafetensorsErrors, TensorInTwoShards) {
  TempDir dir;
  write_safetensors(dir.file("s1.safetensors"),
                    {make_tensor("a", DType::kF32, {2}, 91), make_tensor("dup", DType::kF32, {2}, 92)});
  write_safetensors(dir.file("s2.safetensors"), {make_tensor("dup", DType::kF32, {2}, 93)});
  write_text(dir.file("model.safetensors.index.json"),
             R"({"weight_map": {"a": "s1.safetensors", "dup": "s2.safetensors"}})");
  const std::string msg = error_of([&] { SafetensorsArchive archive(dir.path().string()); });
  EXPECT_THAT(msg, HasSubstr("'dup'"));
  EXPECT_THAT(msg, HasSubstr("two shards"));
}

TEST(SafetensorsErrors, ShardFilenameEscapingDirectory) {
  TempDir dir;
  fs::create_directories(dir.path() / "ckpt");
  write_safetensors(dir.file("outside.safetensors"), {make_tensor("a", DType::kF32, {2}, 101)});
  for (const std::string shard : {"../outside.safetensors", "..", "sub/x.safetensors", "/etc/passwd", ""}) {
    write_text((dir.path() / "ckpt" / "model.safetensors.index.json").string(),
               R"({"weight_map": {"a": ")" + shard + R"("}})");
    const std::string msg = error_of([&] { SafetensorsArchive archive((dir.path() / "ckpt").string()); });
    EXPECT_THAT(msg, HasSubstr("\"" + shard + "\"")) << shard;
    EXPECT_THAT(msg, HasSubstr("'a'")) << shard;
    EXPECT_THAT(msg, HasSubstr("not a plain file name")) << shard;
  }
}

TEST(SafetensorsErrors, BadIndexJson) {
  TempDir dir;
  write_text(dir.file("model.safetensors.index.json"), R"({"weight_map": )");
  EXPECT_THAT(error_of([&] { SafetensorsArchive archive(dir.path().string()); }),
              HasSubstr("model.safetensors.index.json"));
  write_text(dir.file("model.safetensors.index.json"), R"({"metadata": {}})");
  EXPECT_THAT(error_of([&] { SafetensorsArchive archive(dir.path().string()); }), HasSubstr("weight_map"));
  write_text(dir.file("model.safetensors.index.json"), R"({"weight_map": {"a": 3}})");
  EXPECT_THAT(error_of([&] { SafetensorsArchive archive(dir.path().string()); }), HasSubstr("'a'"));
}

TEST(SafetensorsErrors, WriterRejectsBadTensors) {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  TensorToWrite short_tensor = make_tensor("short", DType::kBF16, {4, 4}, 111);
  short_tensor.bytes.pop_back();
  std::string msg = error_of([&] { write_safetensors(path, {short_tensor}); });
  EXPECT_THAT(msg, HasSubstr("'short'"));
  EXPECT_THAT(msg, HasSubstr("31 bytes"));
  EXPECT_THAT(msg, HasSubstr("need 32"));
  EXPECT_FALSE(fs::exists(path));

  TensorToWrite negative{"neg", DType::kF32, {-1}, {}};
  EXPECT_THAT(error_of([&] { write_safetensors(path, {negative}); }), HasSubstr("'neg'"));
  const auto t = make_tensor("same", DType::kU8, {2}, 112);
  EXPECT_THAT(error_of([&] { write_safetensors(path, {t, t}); }), HasSubstr("'same'"));
  EXPECT_THAT(error_of([&] { write_safetensors(dir.file("no/such/dir/x.safetensors"), {t}); }),
              HasSubstr("no/such/dir"));
  // Nothing half-written left in the directory.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 0);
}

}  // namespace
}  // namespace dsv4
