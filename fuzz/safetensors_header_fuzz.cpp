// libFuzzer target for parse_safetensors_header: input = 8-byte little-endian data_size (clamped to 2^40)
// followed by the header text. A dsv4::Error is the expected outcome for bad input; any other exception,
// a crash or a sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string_view>

#include "core/error.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr uint64_t kMaxDataSize = uint64_t{1} << 40;
  uint64_t data_size = 0;
  size_t prefix = 0;
  if (size >= 8) {
    for (int i = 7; i >= 0; --i) data_size = (data_size << 8) | data[i];
    if (data_size > kMaxDataSize) data_size %= kMaxDataSize + 1;
    prefix = 8;
  }
  const std::string_view header(reinterpret_cast<const char*>(data + prefix), size - prefix);
  try {
    const auto tensors = dsv4::parse_safetensors_header(header, data_size, "fuzz.safetensors");
    // Invariants of an accepted header.
    uint64_t previous_end = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const dsv4::TensorInfo& t = tensors[i];
      if (t.data_begin > t.data_end || t.data_end > data_size) std::abort();
      if (i > 0 && t.data_begin < tensors[i - 1].data_begin) std::abort();
      if (t.numel() < 0) std::abort();
      if (static_cast<uint64_t>(t.numel()) * dsv4::dtype_size(t.dtype) != t.data_end - t.data_begin)
        std::abort();
      if (t.data_begin != t.data_end) {
        if (t.data_begin < previous_end) std::abort();  // overlap slipped through
        previous_end = t.data_end;
      }
    }
  } catch (const dsv4::Error&) {
    // expected for malformed input
  } catch (const std::exception& e) {
    std::fprintf(stderr, "non-dsv4::Error exception: %s\n", e.what());
    std::abort();
  }
  return 0;
}
