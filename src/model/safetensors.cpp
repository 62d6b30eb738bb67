#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "core/error.h"

namespace dsv4 {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;  // 100 MB, as the reference reader
constexpr int kMaxJsonDepth = 16;                           // real headers nest 3 deep
constexpr uintmax_t kMaxIndexBytes = 100ull * 1000 * 1000;
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

std::string errno_text(int error) { return std::string(std::strerror(error)); }

// Names of JSON value types for error messages.
const char* json_type(const json& value) { return value.type_name(); }

// A JSON number that is a non-negative integer fitting u64 ("-0" included); nullopt otherwise.
std::optional<uint64_t> as_u64(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    if (v >= 0) return static_cast<uint64_t>(v);
  }
  return std::nullopt;
}

// Parses JSON text, rejecting nesting deeper than kMaxJsonDepth. Every failure becomes dsv4::Error.
json parse_json(std::string_view text, const std::string& source, const char* what) {
  json::parser_callback_t depth_guard = [&](int depth, json::parse_event_t, json&) {
    if (depth > kMaxJsonDepth)
      throw Error(source + ": " + what + " nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), depth_guard);
  } catch (const json::exception& e) {
    throw Error(source + ": " + what + " is not valid JSON: " + e.what());
  }
}

std::string tensor_context(const std::string& source, const std::string& name) {
  return source + ": tensor '" + name + "'";
}

TensorInfo parse_tensor_entry(const std::string& name, const json& entry, uint64_t data_size,
                              const std::string& source) {
  const std::string where = tensor_context(source, name);
  DSV4_CHECK(entry.is_object(), where + ": entry must be an object, got " + json_type(entry));

  TensorInfo info;
  info.name = name;

  // dtype
  const auto dtype_it = entry.find("dtype");
  DSV4_CHECK(dtype_it != entry.end(), where + ": missing \"dtype\"");
  DSV4_CHECK(dtype_it->is_string(), where + ": \"dtype\" must be a string, got " + json_type(*dtype_it));
  const std::string& dtype_text = dtype_it->get_ref<const std::string&>();
  const std::optional<DType> dtype = dtype_from_name(dtype_text);
  DSV4_CHECK(dtype.has_value(), where + ": unknown dtype \"" + dtype_text +
                               "\" (known: F32, F16, BF16, I64, I32, F8_E4M3, F8_E8M0, I8, U8)");
  info.dtype = *dtype;

  // shape
  const auto shape_it = entry.find("shape");
  DSV4_CHECK(shape_it != entry.end(), where + ": missing \"shape\"");
  DSV4_CHECK(shape_it->is_array(), where + ": \"shape\" must be an array, got " + json_type(*shape_it));
  info.shape.reserve(shape_it->size());
  bool has_zero = false;
  for (size_t i = 0; i < shape_it->size(); ++i) {
    const json& dim = (*shape_it)[i];
    const std::optional<uint64_t> value = as_u64(dim);
    DSV4_CHECK(value.has_value(), where + ": shape[" + std::to_string(i) +
                                 "] must be a non-negative integer, got " +
                                 (dim.is_number() ? dim.dump() : std::string(json_type(dim))));
    DSV4_CHECK(*value <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
          where + ": shape[" + std::to_string(i) + "] = " + std::to_string(*value) + " is too large");
    has_zero = has_zero || *value == 0;
    info.shape.push_back(static_cast<int64_t>(*value));
  }
  // numel, guarding overflow; a zero dimension makes the product 0 whatever the others are.
  uint64_t numel = 1;
  if (has_zero) {
    numel = 0;
  } else {
    for (const int64_t dim : info.shape) {
      uint64_t product;
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &product) ||
          product > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        std::ostringstream shape_text;
        shape_text << "[";
        for (size_t i = 0; i < info.shape.size(); ++i) shape_text << (i ? ", " : "") << info.shape[i];
        shape_text << "]";
        throw Error(where + ": element count of shape " + shape_text.str() + " overflows int64");
      }
      numel = product;
    }
  }

  // data_offsets
  const auto offsets_it = entry.find("data_offsets");
  DSV4_CHECK(offsets_it != entry.end(), where + ": missing \"data_offsets\"");
  DSV4_CHECK(offsets_it->is_array() && offsets_it->size() == 2,
        where + ": \"data_offsets\" must be an array of two integers, got " +
            (offsets_it->is_array() ? "an array of " + std::to_string(offsets_it->size())
                                    : std::string(json_type(*offsets_it))));
  const std::optional<uint64_t> begin = as_u64((*offsets_it)[0]);
  const std::optional<uint64_t> end = as_u64((*offsets_it)[1]);
  DSV4_CHECK(begin.has_value() && end.has_value(),
        where + ": \"data_offsets\" must be two non-negative integers, got " +
            ((*offsets_it)[0].is_number() ? (*offsets_it)[0].dump() : json_type((*offsets_it)[0])) + ", " +
            ((*offsets_it)[1].is_number() ? (*offsets_it)[1].dump() : json_type((*offsets_it)[1])));
  DSV4_CHECK(*begin <= *end,
        where + ": data_offsets begin " + std::to_string(*begin) + " > end " + std::to_string(*end));
  DSV4_CHECK(*end <= data_size, where + ": data_offsets end " + std::to_string(*end) +
                               " is past the data section (" + std::to_string(data_size) + " bytes)");
  info.data_begin = *begin;
  info.data_end = *end;

  const uint64_t element_size = dtype_size(info.dtype);
  uint64_t expected_bytes;
  const uint64_t actual_bytes = *end - *begin;
  if (__builtin_mul_overflow(numel, element_size, &expected_bytes) || expected_bytes != actual_bytes) {
    throw Error(where + ": byte length " + std::to_string(actual_bytes) + " (data_offsets [" +
                std::to_string(*begin) + ", " + std::to_string(*end) + "]) != " + std::to_string(numel) +
                " elements x " + std::to_string(element_size) + " bytes of " + dtype_text);
  }
  return info;
}

void check_metadata(const json& metadata, const std::string& source) {
  DSV4_CHECK(metadata.is_object(),
        source + ": \"__metadata__\" must be an object of strings, got " + json_type(metadata));
  for (const auto& [key, value] : metadata.items())
    DSV4_CHECK(value.is_string(),
          source + ": \"__metadata__\" value of key '" + key + "' must be a string, got " + json_type(value));
}

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const void* data, size_t size, const std::string& path) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd, bytes, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      throw Error(path + ": write failed: " + errno_text(errno));
    }
    bytes += written;
    size -= static_cast<size_t>(written);
  }
}

std::string read_text_file(const std::filesystem::path& path, uintmax_t max_bytes) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  DSV4_CHECK(!ec, path.string() + ": cannot stat: " + ec.message());
  DSV4_CHECK(size <= max_bytes, path.string() + ": " + std::to_string(size) +
                               " bytes is larger than the limit of " + std::to_string(max_bytes));
  std::ifstream in(path, std::ios::binary);
  DSV4_CHECK(static_cast<bool>(in), path.string() + ": cannot open: " + errno_text(errno));
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  DSV4_CHECK(in.gcount() == static_cast<std::streamsize>(size),
        path.string() + ": short read: " + std::to_string(in.gcount()) + " of " + std::to_string(size) +
            " bytes");
  return text;
}

// A shard name from an index must be a plain file name inside the checkpoint directory.
void check_shard_name(const std::string& shard, const std::string& tensor, const std::string& index_path) {
  const bool bad = shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
                   shard.find('\\') != std::string::npos || shard.find('\0') != std::string::npos;
  DSV4_CHECK(!bad, index_path + ": weight_map['" + tensor + "'] = \"" + shard +
                  "\" is not a plain file name in the checkpoint directory");
}

}  // namespace

int64_t TensorInfo::numel() const {
  // A zero dimension makes the product 0 even when the others would overflow (parse accepts such shapes).
  for (const int64_t dim : shape)
    if (dim == 0) return 0;
  int64_t n = 1;
  for (const int64_t dim : shape) n *= dim;
  return n;
}

std::vector<TensorInfo> parse_safetensors_header(std::string_view header, uint64_t data_size,
                                                 const std::string& source) {
  const json root = parse_json(header, source, "safetensors header");
  DSV4_CHECK(root.is_object(), source + ": safetensors header must be a JSON object, got " + json_type(root));

  std::vector<TensorInfo> tensors;
  tensors.reserve(root.size());
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      check_metadata(entry, source);
      continue;
    }
    tensors.push_back(parse_tensor_entry(name, entry, data_size, source));
  }

  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    if (a.data_begin != b.data_begin) return a.data_begin < b.data_begin;
    if (a.data_end != b.data_end) return a.data_end < b.data_end;
    return a.name < b.name;
  });

  // Overlap: among non-empty tensors sorted by begin, each must start at or after the previous one's end.
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : tensors) {
    if (info.data_begin == info.data_end) continue;  // zero-length tensors may sit anywhere
    if (previous != nullptr && info.data_begin < previous->data_end) {
      throw Error(source + ": tensors '" + previous->name + "' [" + std::to_string(previous->data_begin) +
                  ", " + std::to_string(previous->data_end) + ") and '" + info.name + "' [" +
                  std::to_string(info.data_begin) + ", " + std::to_string(info.data_end) + ") overlap");
    }
    previous = &info;
  }
  return tensors;
}

// ---------------------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open: " + errno_text(errno));
  FdCloser closer{fd};

  struct stat st;
  if (::fstat(fd, &st) != 0) throw Error(path + ": cannot stat: " + errno_text(errno));
  DSV4_CHECK(S_ISREG(st.st_mode), path + ": not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  DSV4_CHECK(file_size >= 8, path + ": truncated: file has " + std::to_string(file_size) +
                            " bytes, fewer than the 8-byte header length");

  void* mapping = ::mmap(nullptr, static_cast<size_t>(file_size), PROT_READ, MAP_PRIVATE, fd, 0);
  if (mapping == MAP_FAILED)
    throw Error(path + ": mmap of " + std::to_string(file_size) + " bytes failed: " + errno_text(errno));
  mapping_ = mapping;
  mapping_size_ = static_cast<size_t>(file_size);

  try {
    const auto* bytes = static_cast<const uint8_t*>(mapping_);
    uint64_t header_size = 0;
    for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[i];  // little-endian
    DSV4_CHECK(header_size <= kMaxHeaderBytes, path + ": header length " + std::to_string(header_size) +
                                              " bytes exceeds the limit of " +
                                              std::to_string(kMaxHeaderBytes));
    DSV4_CHECK(header_size <= file_size - 8, path + ": truncated: header says " + std::to_string(header_size) +
                                            " bytes but file has " + std::to_string(file_size));
    data_section_ = bytes + 8 + header_size;
    const uint64_t data_size = file_size - 8 - header_size;
    const std::string_view header(reinterpret_cast<const char*>(bytes + 8), static_cast<size_t>(header_size));
    tensors_ = parse_safetensors_header(header, data_size, path);
    for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
  } catch (...) {
    ::munmap(mapping_, mapping_size_);
    mapping_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------------------------------------------------
// SafetensorsArchive

SafetensorsArchive::SafetensorsArchive(const std::string& path) : path_(path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path root(path);
  const fs::file_status status = fs::status(root, ec);
  DSV4_CHECK(fs::exists(status), path + ": no such file or directory");

  if (!fs::is_directory(status)) {
    files_.push_back(std::make_unique<SafetensorsFile>(path));
    for (const TensorInfo& info : files_.back()->tensors())
      entries_.emplace(info.name, Entry{files_.back().get(), &info});
    return;
  }

  const fs::path index_path = root / kIndexName;
  if (fs::exists(index_path, ec)) {
    const std::string index_name = index_path.string();
    const json index = parse_json(read_text_file(index_path, kMaxIndexBytes), index_name, "index");
    DSV4_CHECK(index.is_object(), index_name + ": must be a JSON object, got " + json_type(index));
    const auto map_it = index.find("weight_map");
    DSV4_CHECK(map_it != index.end(), index_name + ": missing \"weight_map\"");
    DSV4_CHECK(map_it->is_object(), index_name + ": \"weight_map\" must be an object, got " + json_type(*map_it));

    std::map<std::string, std::vector<std::string>> shard_tensors;  // shard -> tensors the map puts there
    for (const auto& [tensor, shard] : map_it->items()) {
      DSV4_CHECK(shard.is_string(),
            index_name + ": weight_map['" + tensor + "'] must be a string, got " + json_type(shard));
      const std::string& shard_name = shard.get_ref<const std::string&>();
      check_shard_name(shard_name, tensor, index_name);
      shard_tensors[shard_name].push_back(tensor);
    }
    DSV4_CHECK(!shard_tensors.empty(), index_name + ": \"weight_map\" is empty");

    for (const auto& [shard_name, listed] : shard_tensors) {
      const fs::path shard_path = root / shard_name;
      DSV4_CHECK(fs::exists(shard_path, ec), index_name + ": shard \"" + shard_name + "\" (listed for " +
                                            std::to_string(listed.size()) + " tensors, e.g. '" +
                                            listed.front() + "') does not exist: " + shard_path.string());
      files_.push_back(std::make_unique<SafetensorsFile>(shard_path.string()));
      const SafetensorsFile& file = *files_.back();

      std::vector<std::string> missing;
      for (const std::string& tensor : listed)
        if (file.find(tensor) == nullptr) missing.push_back(tensor);
      if (!missing.empty()) {
        std::string list;
        const size_t shown = std::min<size_t>(missing.size(), 10);
        for (size_t i = 0; i < shown; ++i) list += (i ? ", '" : "'") + missing[i] + "'";
        if (missing.size() > shown) list += ", ... (" + std::to_string(missing.size() - shown) + " more)";
        throw Error(index_name + ": " + std::to_string(missing.size()) + " tensor(s) listed for shard \"" +
                    shard_name + "\" are missing from " + file.path() + ": " + list);
      }

      for (const TensorInfo& info : file.tensors()) {
        const auto [it, inserted] = entries_.emplace(info.name, Entry{&file, &info});
        DSV4_CHECK(inserted, index_name + ": tensor '" + info.name +
                            "' appears in two shards: " + it->second.file->path() + " and " + file.path());
      }
    }
    return;
  }

  const fs::path single = root / kSingleName;
  fs::path chosen;
  if (fs::exists(single, ec)) {
    chosen = single;
  } else {
    std::vector<fs::path> candidates;
    for (const fs::directory_entry& entry : fs::directory_iterator(root, ec))
      if (entry.path().extension() == ".safetensors" && entry.is_regular_file(ec))
        candidates.push_back(entry.path());
    DSV4_CHECK(!ec, path + ": cannot list directory: " + ec.message());
    if (candidates.size() != 1) {
      std::sort(candidates.begin(), candidates.end());
      std::string list;
      for (size_t i = 0; i < candidates.size() && i < 10; ++i)
        list += (i ? ", " : "") + candidates[i].filename().string();
      throw Error(path + ": directory has no " + kIndexName + " or " + kSingleName + ", and " +
                  std::to_string(candidates.size()) + " *.safetensors files (need exactly one)" +
                  (list.empty() ? "" : ": " + list));
    }
    chosen = candidates.front();
  }
  files_.push_back(std::make_unique<SafetensorsFile>(chosen.string()));
  for (const TensorInfo& info : files_.back()->tensors())
    entries_.emplace(info.name, Entry{files_.back().get(), &info});
}

std::vector<std::string> SafetensorsArchive::names() const {
  std::vector<std::string> result;
  result.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) result.push_back(name);
  return result;
}

const SafetensorsArchive::Entry* SafetensorsArchive::find(const std::string& name) const {
  const auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

std::vector<float> SafetensorsArchive::read_f32(const std::string& name) const {
  const Entry* entry = find(name);
  DSV4_CHECK(entry != nullptr, path_ + ": tensor '" + name + "' not found");
  const TensorInfo& info = *entry->info;
  std::vector<float> result(static_cast<size_t>(info.numel()));
  if (result.empty()) return result;  // no memcpy through null pointers
  convert_to_f32(info.dtype, entry->file->data(info), result.size(), result.data());
  return result;
}

// ---------------------------------------------------------------------------------------------------------
// Writer

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const TensorToWrite& tensor : tensors) {
    const std::string where = path + ": tensor '" + tensor.name + "'";
    DSV4_CHECK(tensor.name != "__metadata__", where + ": the name is reserved for metadata");
    DSV4_CHECK(seen.insert(tensor.name).second, where + ": written twice");
    const size_t element_size = dtype_size(tensor.dtype);
    DSV4_CHECK(element_size != 0,
          where + ": invalid dtype value " + std::to_string(static_cast<int>(tensor.dtype)));
    uint64_t numel = 1;
    for (size_t i = 0; i < tensor.shape.size(); ++i) {
      DSV4_CHECK(tensor.shape[i] >= 0, where + ": shape[" + std::to_string(i) +
                                      "] = " + std::to_string(tensor.shape[i]) + " is negative");
    }
    bool overflow = false;
    for (const int64_t dim : tensor.shape) overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
    uint64_t expected = 0;
    overflow = overflow || __builtin_mul_overflow(numel, element_size, &expected);
    DSV4_CHECK(!overflow, where + ": element count overflows");
    DSV4_CHECK(tensor.bytes.size() == expected,
          where + ": has " + std::to_string(tensor.bytes.size()) + " bytes, but " + std::to_string(numel) +
              " elements of " + std::string(dtype_name(tensor.dtype)) + " need " + std::to_string(expected));
    header[tensor.name] = {{"dtype", std::string(dtype_name(tensor.dtype))},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, offset + expected}}};
    offset += expected;
  }

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": cannot serialize header (tensor or metadata names must be UTF-8): " + e.what());
  }
  header_text.append((8 - header_text.size() % 8) % 8, ' ');  // 8 + N is a multiple of 8
  uint8_t length[8];
  for (int i = 0; i < 8; ++i)
    length[i] = static_cast<uint8_t>(static_cast<uint64_t>(header_text.size()) >> (8 * i));

  // Temp file beside the target, renamed into place once complete.
  static std::atomic<uint64_t> counter{0};
  std::random_device entropy;
  const std::string temp_path = path + ".tmp." + std::to_string(::getpid()) + "." +
                                std::to_string(counter.fetch_add(1)) + "." + std::to_string(entropy());
  const int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(temp_path + ": cannot create: " + errno_text(errno));
  try {
    FdCloser closer{fd};
    write_all(fd, length, sizeof length, temp_path);
    write_all(fd, header_text.data(), header_text.size(), temp_path);
    for (const TensorToWrite& tensor : tensors)
      write_all(fd, tensor.bytes.data(), tensor.bytes.size(), temp_path);
    if (::fsync(fd) != 0) throw Error(temp_path + ": fsync failed: " + errno_text(errno));
    closer.fd = -1;
    if (::close(fd) != 0) throw Error(temp_path + ": close failed: " + errno_text(errno));
    if (::rename(temp_path.c_str(), path.c_str()) != 0)
      throw Error(path + ": cannot rename " + temp_path + " into place: " + errno_text(errno));
  } catch (...) {
    ::unlink(temp_path.c_str());
    throw;
  }
}

}  // namespace dsv4
