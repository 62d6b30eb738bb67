#include "core/npy.h"

#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include "core/error.h"

namespace dsv4 {

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  std::ostringstream dict;
  dict << "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) dict << shape[i] << (shape.size() == 1 || i + 1 < shape.size() ? ", " : "");
  dict << "), }";
  std::string header = dict.str();
  // Magic (6) + version (2) + length (2) + header, padded with spaces to a multiple of 64, ending in '\n'.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  DSV4_CHECK(out.good(), "cannot open '" + path + "' for writing");
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.write(magic, 8);
  const uint16_t length = static_cast<uint16_t>(header.size());
  out.write(reinterpret_cast<const char*>(&length), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  const int64_t count = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(count * sizeof(float)));
  DSV4_CHECK(out.good(), "failed writing '" + path + "'");
}

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DSV4_CHECK(in.good(), "cannot open '" + path + "'");
  char magic[8];
  in.read(magic, 8);
  DSV4_CHECK(in.good() && std::memcmp(magic, "\x93NUMPY", 6) == 0, "'" + path + "' is not a .npy file");
  uint32_t header_len = 0;
  if (magic[6] == 1) {
    uint16_t len16;
    in.read(reinterpret_cast<char*>(&len16), 2);
    header_len = len16;
  } else {
    in.read(reinterpret_cast<char*>(&header_len), 4);
  }
  std::string header(header_len, '\0');
  in.read(header.data(), header_len);
  DSV4_CHECK(in.good(), "'" + path + "': truncated header");
  auto field = [&](const std::string& key) {
    const auto pos = header.find("'" + key + "'");
    DSV4_CHECK(pos != std::string::npos, "'" + path + "': header has no " + key);
    return pos + key.size() + 2;
  };
  const auto descr_pos = header.find('\'', header.find(':', field("descr")));
  const std::string descr = header.substr(descr_pos + 1, header.find('\'', descr_pos + 1) - descr_pos - 1);
  DSV4_CHECK(header.find("'fortran_order': True") == std::string::npos,
        "'" + path + "': fortran_order arrays are not supported");
  NpyArray array;
  const auto open = header.find('(', field("shape")), close = header.find(')', open);
  std::stringstream dims(header.substr(open + 1, close - open - 1));
  for (std::string item; std::getline(dims, item, ',');)
    if (item.find_first_not_of(' ') != std::string::npos) array.shape.push_back(std::stoll(item));
  const int64_t count = std::accumulate(array.shape.begin(), array.shape.end(), int64_t{1}, std::multiplies<>());
  array.data.resize(static_cast<size_t>(count));
  auto read_as = [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> raw(static_cast<size_t>(count));
    in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(count * sizeof(T)));
    DSV4_CHECK(in.good() || (count == 0), "'" + path + "': truncated data");
    for (int64_t i = 0; i < count; ++i) array.data[i] = static_cast<float>(raw[i]);
  };
  if (descr == "<f4") read_as(float{});
  else if (descr == "<f8") read_as(double{});
  else if (descr == "<i8") read_as(int64_t{});
  else if (descr == "<i4") read_as(int32_t{});
  else throw Error("'" + path + "': unsupported dtype '" + descr + "'");
  return array;
}

}  // namespace dsv4
