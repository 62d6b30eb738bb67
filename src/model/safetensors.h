// safetensors checkpoints: one file or a shard set with model.safetensors.index.json, memory-mapped.
//
// File layout (https://huggingface.co/docs/safetensors): u64 little-endian header length N, then N bytes of
// JSON {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}},
// then the data section; offsets are relative to the data section's start.
//
// The header is validated before any tensor is handed out: every offset pair in bounds and ordered, no two
// tensors overlapping, byte length == dtype size x product(shape), known dtype. A violation throws
// dsv4::Error naming the file, the tensor and the numbers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace dsv4 {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0, data_end = 0;  // relative to the data section
  int64_t numel() const;
};

// Parses and validates a safetensors header. `header` is the JSON text, `data_size` the byte length of the
// data section that follows it. `source` names the file in error messages. Pure function: the fuzz target.
std::vector<TensorInfo> parse_safetensors_header(std::string_view header, uint64_t data_size,
                                                 const std::string& source);

// One memory-mapped .safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  // Pointer to the raw bytes of a tensor (valid while this object lives).
  const uint8_t* data(const TensorInfo& info) const { return data_section_ + info.data_begin; }

 private:
  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  const uint8_t* data_section_ = nullptr;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
};

// A checkpoint directory or file: `model.safetensors`, or the shards listed by
// `model.safetensors.index.json` ("weight_map": {tensor: shard file}).
class SafetensorsArchive {
 public:
  // `path` is a directory (index.json preferred, else model.safetensors, else the single *.safetensors
  // file) or one .safetensors file.
  explicit SafetensorsArchive(const std::string& path);

  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  std::vector<std::string> names() const;
  const Entry* find(const std::string& name) const;
  // Reads a tensor as fp32 (any dtype; integer tensors by value). Throws if absent.
  std::vector<float> read_f32(const std::string& name) const;

 private:
  std::string path_;  // as given, for error messages
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry, std::less<>> entries_;
};

// Writes a single-file safetensors checkpoint (tensors in the given order, 8-byte aligned header).
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // little-endian, dtype_size * numel
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace dsv4
