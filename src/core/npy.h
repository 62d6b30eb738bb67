// NumPy .npy files (format 1.0/2.0, little-endian float32/int64, C order): logits dumps and goldens.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;  // converted to float32
};

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);
// Reads '<f4', '<f8', '<i8' or '<i4' arrays; anything else fails with the file name and the descr.
NpyArray read_npy(const std::string& path);

}  // namespace dsv4
