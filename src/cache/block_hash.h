// Prefix-cache block hashes (docs/cache.md "Prefix caching"): every full 256-token logical block of a sequence is
// named by XXH3_64(its token ids, seed = the previous block's hash), the first block seeded by XXH3(salt). One
// definition shared by HybridKvCacheManager (which caches blocks under these names) and DataParallelRouter (which
// mirrors each rank's cached names to route a prompt to the rank holding its longest prefix): the two must agree
// bit for bit, so neither keeps its own copy.
#pragma once
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace dsv4 {

// The parent hash of a sequence's first logical block: XXH3_64 of the salt (model identity, tenant).
uint64_t prefix_root_hash(std::string_view salt);

// The chain hash of one logical block: XXH3_64 of its token ids (as int32 bytes) seeded with the parent's hash.
uint64_t chain_block_hash(uint64_t parent, std::span<const int32_t> block_tokens);

// Chain hashes of the first `max_blocks` full logical blocks of `tokens` (fewer if tokens has fewer full blocks).
std::vector<uint64_t> logical_block_hashes(uint64_t root, std::span<const int32_t> tokens, int64_t max_blocks);

}  // namespace dsv4
