#include "cache/block_hash.h"

#include <algorithm>

#include <xxhash.h>

#include "cache/cache_spec.h"

namespace dsv4 {

uint64_t prefix_root_hash(std::string_view salt) { return XXH3_64bits(salt.data(), salt.size()); }

uint64_t chain_block_hash(uint64_t parent, std::span<const int32_t> block_tokens) {
  return XXH3_64bits_withSeed(block_tokens.data(), block_tokens.size_bytes(), parent);
}

std::vector<uint64_t> logical_block_hashes(uint64_t root, std::span<const int32_t> tokens, int64_t max_blocks) {
  const int64_t full_blocks = static_cast<int64_t>(tokens.size()) / kLogicalBlockTokens;
  const int64_t count = std::max<int64_t>(0, std::min(max_blocks, full_blocks));
  std::vector<uint64_t> hashes;
  hashes.reserve(static_cast<size_t>(count));
  uint64_t parent = root;
  for (int64_t b = 0; b < count; ++b) {
    parent = chain_block_hash(parent, tokens.subspan(static_cast<size_t>(b * kLogicalBlockTokens),
                                                     static_cast<size_t>(kLogicalBlockTokens)));
    hashes.push_back(parent);
  }
  return hashes;
}

}  // namespace dsv4
