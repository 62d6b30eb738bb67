// Byte-level BPE tokenizer: see tokenizer.h for the pipeline and docs/tokenizer.md for the design.
#include "tokenizer/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "core/error.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------- UTF-8
// helpers

// Length of the valid UTF-8 sequence at s[i], or 0 when it is invalid (WHATWG rules: no overlongs, no
// surrogates, <= U+10FFFF). `maximal` receives the length of the maximal invalid subpart when invalid.
size_t utf8_sequence(std::string_view s, size_t i, uint32_t* cp, size_t* maximal) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  *maximal = 1;
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t n;
  uint8_t lo = 0x80, hi = 0xBF;
  uint32_t v;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, v = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, v = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k < n; ++k) {
    if (i + k >= s.size()) return 0;
    const uint8_t t = b(i + k);
    if (t < lo || t > hi) return 0;
    lo = 0x80, hi = 0xBF;
    v = (v << 6) | (t & 0x3F);
    *maximal = k + 1;
  }
  *cp = v;
  return n;
}

// Unicode White_Space (what Rust's char::is_whitespace and Oniguruma's \s use).
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}
constexpr std::string_view kWhiteSpaceClass =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
    "\\x{3000}";

// The GPT-2 byte -> printable code point table (bytes_to_unicode in HF tokenizers).
struct ByteAlphabet {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 324> to_byte{};  // code point -> byte, -1 when not in the alphabet
  ByteAlphabet() {
    to_byte.fill(-1);
    uint32_t extra = 256;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable = (byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || byte >= 174;
      to_cp[byte] = printable ? static_cast<uint32_t>(byte) : extra++;
      to_byte[to_cp[byte]] = static_cast<int16_t>(byte);
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet table;
  return table;
}

// A token spelled in the byte alphabet -> raw bytes; nullopt when a character is outside the alphabet.
std::optional<std::string> byte_level_decode(std::string_view token) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    uint32_t cp;
    size_t maximal;
    const size_t n = utf8_sequence(token, i, &cp, &maximal);
    if (n == 0 || cp >= alphabet().to_byte.size() || alphabet().to_byte[cp] < 0) return std::nullopt;
    out += static_cast<char>(alphabet().to_byte[cp]);
    i += n;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ PCRE2
// regex

// Rewrites \s and \S into Unicode White_Space classes: PCRE2's UCP \s is "Z or \t\n\v\f\r", which lacks
// U+0085; HF tokenizers (Oniguruma) matches White_Space. Everything else is handed to PCRE2 unchanged.
std::string translate_pattern(const std::string& pattern) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      if (e == 'Q') throw Error("tokenizer: regex \\Q...\\E is not supported in pattern " + pattern);
      if (e == 's') {
        out += in_class ? std::string(kWhiteSpaceClass) : "[" + std::string(kWhiteSpaceClass) + "]";
      } else if (e == 'S') {
        if (in_class)
          throw Error("tokenizer: \\S inside a character class is not supported in pattern " + pattern);
        out += "[^" + std::string(kWhiteSpaceClass) + "]";
      } else {
        out += c;
        out += e;
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];  // literal ] first in class
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {  // [:posix:]
      const size_t end = pattern.find(":]", i + 2);
      if (end != std::string::npos) {
        out.append(pattern, i, end + 2 - i);
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

class Regex {
 public:
  Regex(const std::string& pattern, bool literal) : pattern_(pattern) {
    const std::string translated = literal ? pattern : translate_pattern(pattern);
    int error = 0;
    PCRE2_SIZE error_offset = 0;
    const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(), options, &error,
                          &error_offset, nullptr);
    if (code_ == nullptr) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(error, message.data(), message.size());
      throw Error("tokenizer: cannot compile Split regex '" + pattern + "' at offset " +
                  std::to_string(error_offset) + ": " + reinterpret_cast<const char*>(message.data()));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }

  // Finds the first match in subject[offset..]; returns false when there is none.
  bool find(std::string_view subject, size_t offset, size_t* begin, size_t* end) const;
  const std::string& pattern() const { return pattern_; }
  bool jit() const { return jit_; }

 private:
  std::string pattern_;
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// Per-thread match state: one ovector pair is all we read (rc == 0 then only means "more groups than slots").
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

bool Regex::find(std::string_view subject, size_t offset, size_t* begin, size_t* end) const {
  thread_local MatchState state;
  const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), offset,
                             PCRE2_NO_UTF_CHECK, state.data, state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    std::array<PCRE2_UCHAR, 256> message{};
    pcre2_get_error_message(rc, message.data(), message.size());
    throw Error("tokenizer: regex '" + pattern_ + "' failed on a " + std::to_string(subject.size()) +
                "-byte piece: " + reinterpret_cast<const char*>(message.data()));
  }
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
  *begin = ovector[0];
  *end = ovector[1];
  return true;
}

// ----------------------------------------------------------------------------------------------
// pre-tokenizer

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

SplitBehavior parse_behavior(const std::string& name) {
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  throw Error("tokenizer: unsupported Split behavior '" + name + "'");
}

struct SplitStep {
  std::unique_ptr<Regex> regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

struct Range {
  size_t begin, end;
};

// HF NormalizedString::split on one piece: ranges relative to `piece`, appended to `out` (empty ones
// dropped).
void split_piece(const SplitStep& step, std::string_view piece, std::vector<Range>& out,
                 std::vector<std::pair<Range, bool>>& matches) {
  matches.clear();
  size_t prev = 0, offset = 0;
  while (offset <= piece.size()) {
    size_t b, e;
    if (!step.regex->find(piece, offset, &b, &e)) break;
    if (b > prev) matches.push_back({{prev, b}, false});
    matches.push_back({{b, e}, true});
    prev = e;
    if (e == b) {  // empty match: step over one code point
      if (e >= piece.size()) break;
      offset = e + 1;
      while (offset < piece.size() && (static_cast<uint8_t>(piece[offset]) & 0xC0) == 0x80) ++offset;
    } else {
      offset = e;
    }
  }
  if (prev < piece.size()) matches.push_back({{prev, piece.size()}, false});
  if (step.invert)
    for (auto& m : matches) m.second = !m.second;

  const auto push = [&](Range r) {
    if (r.end > r.begin) out.push_back(r);
  };
  const size_t first = out.size();
  switch (step.behavior) {
    case SplitBehavior::kRemoved:
      for (const auto& [r, is_match] : matches)
        if (!is_match) push(r);
      return;
    case SplitBehavior::kIsolated:
      for (const auto& [r, is_match] : matches) push(r);
      return;
    case SplitBehavior::kMergedWithPrevious: {
      std::vector<Range> acc;
      bool previous_match = false;
      for (const auto& [r, is_match] : matches) {
        if (is_match && !previous_match && !acc.empty()) {
          acc.back().end = r.end;
        } else {
          acc.push_back(r);
        }
        previous_match = is_match;
      }
      for (const Range r : acc) push(r);
      return;
    }
    case SplitBehavior::kMergedWithNext: {
      std::vector<Range> acc;
      bool previous_match = false;
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        if (it->second && !previous_match && !acc.empty()) {
          acc.back().begin = it->first.begin;
        } else {
          acc.push_back(it->first);
        }
        previous_match = it->second;
      }
      for (auto it = acc.rbegin(); it != acc.rend(); ++it) push(*it);
      return;
    }
    case SplitBehavior::kContiguous: {
      std::vector<Range> acc;
      bool previous_match = false;
      for (const auto& [r, is_match] : matches) {
        if (is_match == previous_match && !acc.empty()) {
          acc.back().end = r.end;
        } else {
          acc.push_back(r);
        }
        previous_match = is_match;
      }
      for (const Range r : acc) push(r);
      return;
    }
  }
  (void)first;
}

// ------------------------------------------------------------------------------------------------ word cache

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Piece bytes -> ids. Sharded so that concurrent encodes rarely contend; each shard stops growing at its
// capacity (like HF's BPE cache) instead of evicting.
class WordCache {
 public:
  static constexpr size_t kShards = 64;
  static constexpr size_t kShardCapacity = 4096;
  static constexpr size_t kMaxWordBytes = 256;

  bool lookup(std::string_view word, size_t hash, std::vector<int32_t>& out) const {
    Shard& shard = shards_[hash % kShards];
    std::lock_guard<std::mutex> lock(shard.mutex);
    const auto it = shard.map.find(word);
    if (it == shard.map.end()) return false;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return true;
  }
  void insert(std::string_view word, size_t hash, std::span<const int32_t> ids) const {
    Shard& shard = shards_[hash % kShards];
    std::lock_guard<std::mutex> lock(shard.mutex);
    if (shard.map.size() >= kShardCapacity) return;
    shard.map.emplace(std::string(word), std::vector<int32_t>(ids.begin(), ids.end()));
  }

 private:
  struct Shard {
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
  };
  mutable std::array<Shard, kShards> shards_;
};

// ------------------------------------------------------------------------------------------------ added
// tokens

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false, normalized = false, lstrip = false, rstrip = false, single_word = false;
};

// Byte trie for leftmost-longest matching of added tokens.
class TokenTrie {
 public:
  void add(const std::string& content, int32_t token_index) {
    if (content.empty()) return;
    if (nodes_.empty()) nodes_.emplace_back();
    first_byte_[static_cast<uint8_t>(content[0])] = true;
    int32_t node = 0;
    for (const char c : content) {
      const uint8_t byte = static_cast<uint8_t>(c);
      int32_t next = child(node, byte);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.push_back({byte, next});
        nodes_.emplace_back();
      }
      node = next;
    }
    nodes_[node].token = token_index;
  }
  bool empty() const { return nodes_.empty(); }
  // Longest token starting at text[i]: its index and length, or -1.
  int32_t longest_at(std::string_view text, size_t i, size_t* length) const {
    if (nodes_.empty() || !first_byte_[static_cast<uint8_t>(text[i])]) return -1;
    int32_t node = 0, best = -1;
    for (size_t j = i; j < text.size(); ++j) {
      node = child(node, static_cast<uint8_t>(text[j]));
      if (node < 0) break;
      if (nodes_[node].token >= 0) best = nodes_[node].token, *length = j + 1 - i;
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t token = -1;
  };
  int32_t child(int32_t node, uint8_t byte) const {
    for (const auto& [b, next] : nodes_[node].children)
      if (b == byte) return next;
    return -1;
  }
  std::vector<Node> nodes_;
  std::array<bool, 256> first_byte_{};
};

bool is_word_byte(uint8_t c) { return std::isalnum(c) || c == '_'; }

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("tokenizer: cannot open " + path.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string type_of(const json& j, const std::string& component) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    throw Error("tokenizer: " + component + " has no \"type\" string");
  return j["type"].get<std::string>();
}

// A flag that must be false/null/absent for us to support the component.
void require_unset(const json& j, const std::string& key, const std::string& component) {
  if (!j.contains(key) || j[key].is_null()) return;
  const json& v = j[key];
  if ((v.is_boolean() && !v.get<bool>()) || (v.is_string() && v.get<std::string>().empty())) return;
  throw Error("tokenizer: " + component + " option " + key + "=" + v.dump() + " is not supported");
}

}  // namespace

// --------------------------------------------------------------------------------------------------
// Tokenizer

struct Tokenizer::Impl {
  std::string description;
  // Model (BPE).
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_ids;  // tokenizer.json spelling
  std::vector<std::string> id_tokens;                                               // id -> spelling
  std::vector<std::string> id_bytes;                                                // id -> decoded bytes
  std::vector<bool> id_present, id_special;
  std::array<int32_t, 256> byte_ids{};
  struct Merge {
    int32_t rank, id;
  };
  std::unordered_map<uint64_t, Merge> merges;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> raw_vocab;  // bytes -> id
  bool ignore_merges = false;
  // Added tokens: pass 1 matches the non-normalized ones on the raw text, pass 2 the normalized ones.
  std::vector<AddedToken> added;
  TokenTrie raw_trie, normalized_trie;
  // Pre-tokenizer.
  std::vector<SplitStep> steps;
  WordCache cache;
  // tokenizer_config.json.
  std::optional<int32_t> bos, eos;
  bool add_bos = false, add_eos = false;

  void parse(const json& root, const json* config);
  void encode_section(std::string_view text, std::vector<int32_t>& out) const;
  void encode_added(std::string_view text, const TokenTrie& trie, bool last_pass,
                    std::vector<int32_t>& out) const;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
};

void Tokenizer::Impl::parse(const json& root, const json* config) {
  if (!root.is_object()) throw Error("tokenizer: tokenizer.json is not a JSON object");
  std::string desc;

  // Normalizer: only the identity (null or an empty/nested Sequence) — anything else changes the text.
  const std::function<std::string(const json&)> check_normalizer = [&](const json& n) -> std::string {
    if (n.is_null()) return "null";
    const std::string type = type_of(n, "normalizer");
    if (type != "Sequence") throw Error("tokenizer: unsupported normalizer type '" + type + "'");
    std::string s = "Sequence[";
    for (const json& child : n.value("normalizers", json::array())) s += check_normalizer(child) + ",";
    return s + "]";
  };
  desc += "normalizer=" + check_normalizer(root.value("normalizer", json())) + " ";

  // Pre-tokenizer: Sequence / Split / ByteLevel.
  bool byte_level = false;
  const std::function<std::string(const json&)> add_pre = [&](const json& p) -> std::string {
    const std::string type = type_of(p, "pre_tokenizer");
    if (type == "Sequence") {
      std::string s = "Sequence[";
      for (const json& child : p.value("pretokenizers", json::array())) s += add_pre(child) + ",";
      return s + "]";
    }
    if (byte_level) throw Error("tokenizer: pre_tokenizer " + type + " after ByteLevel is not supported");
    if (type == "Split") {
      SplitStep step;
      const json& pattern = p.at("pattern");
      if (pattern.contains("Regex")) {
        step.regex = std::make_unique<Regex>(pattern["Regex"].get<std::string>(), false);
      } else if (pattern.contains("String")) {
        step.regex = std::make_unique<Regex>(pattern["String"].get<std::string>(), true);
      } else {
        throw Error("tokenizer: Split pattern " + pattern.dump() + " is neither Regex nor String");
      }
      step.behavior = parse_behavior(p.value("behavior", std::string("Isolated")));
      step.invert = p.value("invert", false);
      const std::string s =
          "Split(" + p.value("behavior", std::string("Isolated")) + (step.regex->jit() ? ",jit" : "") + ")";
      steps.push_back(std::move(step));
      return s;
    }
    if (type == "ByteLevel") {
      require_unset(p, "add_prefix_space", "ByteLevel pre_tokenizer");
      byte_level = true;
      if (p.value("use_regex", true)) {
        SplitStep step;
        step.regex = std::make_unique<Regex>(
            "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+", false);
        steps.push_back(std::move(step));
        return "ByteLevel(regex)";
      }
      return "ByteLevel";
    }
    throw Error("tokenizer: unsupported pre_tokenizer type '" + type + "'");
  };
  if (!root.contains("pre_tokenizer") || root["pre_tokenizer"].is_null())
    throw Error("tokenizer: pre_tokenizer null is not supported (a byte-level BPE needs ByteLevel)");
  desc += "pre_tokenizer=" + add_pre(root["pre_tokenizer"]) + " ";
  if (!byte_level)
    throw Error("tokenizer: pre_tokenizer has no ByteLevel step; only byte-level BPE is supported");

  // Model: BPE over the byte alphabet.
  const json& model = root.at("model");
  const std::string model_type = model.value("type", std::string("BPE"));
  if (model_type != "BPE") throw Error("tokenizer: unsupported model type '" + model_type + "'");
  require_unset(model, "dropout", "BPE model");
  require_unset(model, "continuing_subword_prefix", "BPE model");
  require_unset(model, "end_of_word_suffix", "BPE model");
  require_unset(model, "byte_fallback", "BPE model");
  ignore_merges = model.value("ignore_merges", false);
  int32_t max_id = -1;
  for (const auto& [token, id_json] : model.at("vocab").items()) {
    const int32_t id = id_json.get<int32_t>();
    if (id < 0) throw Error("tokenizer: vocab token " + token + " has negative id " + std::to_string(id));
    token_ids[token] = id;
    max_id = std::max(max_id, id);
  }
  for (const json& a : root.value("added_tokens", json::array())) {
    AddedToken t;
    t.id = a.at("id").get<int32_t>();
    t.content = a.at("content").get<std::string>();
    t.special = a.value("special", false);
    t.normalized = a.value("normalized", !t.special);
    t.lstrip = a.value("lstrip", false);
    t.rstrip = a.value("rstrip", false);
    t.single_word = a.value("single_word", false);
    if (t.id < 0) throw Error("tokenizer: added token " + t.content + " has negative id");
    if (find_invalid_utf8(t.content) != std::string::npos)
      throw Error("tokenizer: added token " + std::to_string(t.id) + " is not valid UTF-8");
    max_id = std::max(max_id, t.id);
    added.push_back(std::move(t));
  }
  id_tokens.assign(max_id + 1, std::string());
  id_bytes.assign(max_id + 1, std::string());
  id_present.assign(max_id + 1, false);
  id_special.assign(max_id + 1, false);
  // The ByteLevel decoder: a token made only of alphabet characters decodes to those bytes, any other token
  // to its own UTF-8 bytes.
  const auto set_id = [&](int32_t id, const std::string& token) {
    id_tokens[id] = token;
    id_bytes[id] = byte_level_decode(token).value_or(token);
    id_present[id] = true;
  };
  for (const auto& [token, id] : token_ids) {
    set_id(id, token);
    if (const auto raw = byte_level_decode(token)) raw_vocab[*raw] = id;
  }
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& t = added[i];
    set_id(t.id, t.content);
    id_special[t.id] = t.special;
    token_ids[t.content] = t.id;
    (t.normalized ? normalized_trie : raw_trie).add(t.content, static_cast<int32_t>(i));
  }
  for (int byte = 0; byte < 256; ++byte) {
    const auto it = raw_vocab.find(std::string(1, static_cast<char>(byte)));
    if (it == raw_vocab.end())
      throw Error("tokenizer: BPE vocab lacks the byte-level token for byte " + std::to_string(byte));
    byte_ids[byte] = it->second;
  }
  const json& merges_json = model.at("merges");
  for (size_t rank = 0; rank < merges_json.size(); ++rank) {
    const json& m = merges_json[rank];
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos)
        throw Error("tokenizer: merge " + std::to_string(rank) + " '" + s + "' has no space");
      left = s.substr(0, space), right = s.substr(space + 1);
    } else {
      left = m.at(0).get<std::string>(), right = m.at(1).get<std::string>();
    }
    const auto l = token_ids.find(left), r = token_ids.find(right), merged = token_ids.find(left + right);
    if (l == token_ids.end() || r == token_ids.end() || merged == token_ids.end())
      throw Error("tokenizer: merge " + std::to_string(rank) + " '" + left + " " + right +
                  "' uses a token not in the vocab");
    const uint64_t key =
        (static_cast<uint64_t>(static_cast<uint32_t>(l->second)) << 32) | static_cast<uint32_t>(r->second);
    merges.emplace(key, Merge{static_cast<int32_t>(rank), merged->second});
  }
  desc += "model=BPE(vocab=" + std::to_string(model.at("vocab").size()) +
          ",merges=" + std::to_string(merges_json.size()) + ") added_tokens=" + std::to_string(added.size()) +
          " ";

  // Post-processor: ByteLevel only adjusts offsets; we produce no offsets.
  const json post = root.value("post_processor", json());
  if (!post.is_null()) {
    const std::string type = type_of(post, "post_processor");
    if (type != "ByteLevel") throw Error("tokenizer: unsupported post_processor type '" + type + "'");
    desc += "post_processor=ByteLevel ";
  }
  const json decoder = root.value("decoder", json());
  if (decoder.is_null())
    throw Error("tokenizer: decoder null is not supported (byte-level BPE needs ByteLevel)");
  const std::string decoder_type = type_of(decoder, "decoder");
  if (decoder_type != "ByteLevel") throw Error("tokenizer: unsupported decoder type '" + decoder_type + "'");
  desc += "decoder=ByteLevel";

  if (config != nullptr && config->is_object()) {
    const auto token_of = [&](const char* key) -> std::optional<int32_t> {
      if (!config->contains(key)) return std::nullopt;
      const json& v = (*config)[key];
      std::string content;
      if (v.is_string()) {
        content = v.get<std::string>();
      } else if (v.is_object() && v.contains("content")) {
        content = v["content"].get<std::string>();
      } else {
        return std::nullopt;
      }
      const auto it = token_ids.find(content);
      if (it == token_ids.end())
        throw Error(std::string("tokenizer: tokenizer_config ") + key + " '" + content + "' is not a token");
      return it->second;
    };
    bos = token_of("bos_token");
    eos = token_of("eos_token");
    add_bos = config->value("add_bos_token", false) && bos.has_value();
    add_eos = config->value("add_eos_token", false) && eos.has_value();
  }
  description = desc;
}

// Splits `text` on the added tokens of `trie` (leftmost-longest); the remainder goes to the next pass.
void Tokenizer::Impl::encode_added(std::string_view text, const TokenTrie& trie, bool last_pass,
                                   std::vector<int32_t>& out) const {
  const auto rest = [&](std::string_view section) {
    if (section.empty()) return;
    if (last_pass) {
      encode_section(section, out);
    } else {
      encode_added(section, normalized_trie, true, out);
    }
  };
  size_t start = 0, i = 0;
  while (i < text.size()) {
    size_t length = 0;
    const int32_t index = trie.empty() ? -1 : trie.longest_at(text, i, &length);
    if (index < 0) {
      ++i;
      continue;
    }
    const AddedToken& t = added[index];
    size_t b = i, e = i + length;
    if (t.single_word &&
        ((b > 0 && is_word_byte(text[b - 1])) || (e < text.size() && is_word_byte(text[e])))) {
      ++i;
      continue;
    }
    if (t.lstrip) {  // swallow White_Space to the left, back to the end of the previous match
      while (b > start) {
        size_t k = b - 1;
        while (k > start && (static_cast<uint8_t>(text[k]) & 0xC0) == 0x80) --k;
        uint32_t cp;
        size_t maximal;
        if (utf8_sequence(text, k, &cp, &maximal) == 0 || !is_white_space(cp)) break;
        b = k;
      }
    }
    if (t.rstrip) {
      while (e < text.size()) {
        uint32_t cp;
        size_t maximal;
        const size_t n = utf8_sequence(text, e, &cp, &maximal);
        if (n == 0 || !is_white_space(cp)) break;
        e += n;
      }
    }
    rest(text.substr(start, b - start));
    out.push_back(t.id);
    start = i = e;
  }
  rest(text.substr(start));
}

void Tokenizer::Impl::encode_section(std::string_view text, std::vector<int32_t>& out) const {
  thread_local std::vector<Range> pieces, next;
  thread_local std::vector<std::pair<Range, bool>> matches;
  pieces.clear();
  pieces.push_back({0, text.size()});
  for (const SplitStep& step : steps) {
    next.clear();
    for (const Range piece : pieces) {
      const size_t before = next.size();
      split_piece(step, text.substr(piece.begin, piece.end - piece.begin), next, matches);
      for (size_t k = before; k < next.size(); ++k) next[k].begin += piece.begin, next[k].end += piece.begin;
    }
    std::swap(pieces, next);
  }
  // `pieces` is thread_local and bpe() does not touch it, so iterate a copy-free view.
  for (const Range piece : pieces) bpe(text.substr(piece.begin, piece.end - piece.begin), out);
}

void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() == 1) {
    out.push_back(byte_ids[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (ignore_merges) {
    const auto it = raw_vocab.find(word);
    if (it != raw_vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  const size_t hash = cacheable ? StringHash{}(word) : 0;
  if (cacheable && cache.lookup(word, hash, out)) return;

  // Symbols are a doubly linked list over the word's bytes; the queue holds candidate merges ordered by
  // (rank, position of the left symbol), as HF's word.rs merge_all does.
  struct Symbol {
    int32_t id, prev, next;
    bool alive;
  };
  struct Candidate {
    int32_t rank, pos, id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap_storage;
  const int32_t n = static_cast<int32_t>(word.size());
  symbols.resize(n);
  for (int32_t k = 0; k < n; ++k)
    symbols[k] = {byte_ids[static_cast<uint8_t>(word[k])], k - 1, k + 1 < n ? k + 1 : -1, true};
  heap_storage.clear();
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue(std::greater<>{},
                                                                               std::move(heap_storage));
  const auto candidate = [&](int32_t left) {
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(symbols[left].id)) << 32) |
                         static_cast<uint32_t>(symbols[right].id);
    const auto it = merges.find(key);
    if (it != merges.end()) queue.push({it->second.rank, left, it->second.id});
  };
  for (int32_t k = 0; k + 1 < n; ++k) candidate(k);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const Symbol& right = symbols[left.next];
    const uint64_t key =
        (static_cast<uint64_t>(static_cast<uint32_t>(left.id)) << 32) | static_cast<uint32_t>(right.id);
    const auto it = merges.find(key);
    if (it == merges.end() || it->second.id != top.id) continue;  // stale: a neighbour changed
    const int32_t right_index = left.next;
    left.id = top.id;
    left.next = right.next;
    symbols[right_index].alive = false;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) candidate(left.prev);
    candidate(top.pos);
  }
  const size_t first = out.size();
  for (int32_t k = 0; k >= 0; k = symbols[k].next) out.push_back(symbols[k].id);
  if (cacheable) cache.insert(word, hash, std::span<const int32_t>(out.data() + first, out.size() - first));
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& source) {
  json root, config;
  try {
    root = json::parse(tokenizer_json);
    if (!config_json.empty()) config = json::parse(config_json);
  } catch (const json::exception& e) {
    throw Error("tokenizer: cannot parse " + source + ": " + e.what());
  }
  auto impl = std::make_unique<Impl>();
  try {
    impl->parse(root, config.is_null() ? nullptr : &config);
  } catch (const json::exception& e) {
    throw Error("tokenizer: malformed " + source + ": " + e.what());
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path file = path;
  if (fs::is_directory(file)) file /= "tokenizer.json";
  if (!fs::exists(file)) throw Error("tokenizer: no tokenizer.json at " + path);
  const fs::path config = file.parent_path() / "tokenizer_config.json";
  return from_json(read_file(file), fs::exists(config) ? read_file(config) : std::string(), file.string());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const size_t bad = find_invalid_utf8(text);
  if (bad != std::string::npos)
    throw Error("tokenizer: encode input is not valid UTF-8 at byte offset " + std::to_string(bad));
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special_tokens && impl_->add_bos) out.push_back(*impl_->bos);
  impl_->encode_added(text, impl_->raw_trie, false, out);
  if (add_special_tokens && impl_->add_eos) out.push_back(*impl_->eos);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (id < 0 || id >= vocab_size() || !impl_->id_present[id])
      throw Error("tokenizer: decode got id " + std::to_string(id) + ", not a token (vocab_size " +
                  std::to_string(vocab_size()) + ")");
    if (skip_special_tokens && impl_->id_special[id]) continue;
    bytes += impl_->id_bytes[id];
  }
  return utf8_lossy(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->token_ids.find(token);
  if (it == impl_->token_ids.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size() || !impl_->id_present[id]) return std::nullopt;
  return impl_->id_tokens[id];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_tokens.size()); }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
bool Tokenizer::add_bos_token() const { return impl_->add_bos; }
bool Tokenizer::add_eos_token() const { return impl_->add_eos; }
bool Tokenizer::is_special(int32_t id) const { return id >= 0 && id < vocab_size() && impl_->id_special[id]; }
const std::string& Tokenizer::describe() const { return impl_->description; }

size_t find_invalid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    if (static_cast<uint8_t>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    uint32_t cp;
    size_t maximal;
    const size_t n = utf8_sequence(text, i, &cp, &maximal);
    if (n == 0) return i;
    i += n;
  }
  return std::string::npos;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    uint32_t cp;
    size_t maximal;
    const size_t n = utf8_sequence(bytes, i, &cp, &maximal);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      i += maximal;
    } else {
      out.append(bytes.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace dsv4
