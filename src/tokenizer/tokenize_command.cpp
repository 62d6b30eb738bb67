#include "tokenizer/tokenize_command.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <string>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace dsv4 {

std::vector<int32_t> parse_token_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t i = 0;
  const auto is_separator = [](char c) {
    // Also the brackets, so tokenize's JSON array can be pasted back in.
    return c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '[' || c == ']';
  };
  while (i < text.size()) {
    if (is_separator(text[i])) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < text.size() && !is_separator(text[end])) ++end;
    const std::string item = text.substr(i, end - i);
    size_t used = 0;
    long long value = -1;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DSV4_CHECK(used == item.size() && value >= 0 && value <= std::numeric_limits<int32_t>::max(),
               "--ids: '" + item + "' is not a token id (in \"" + text + "\")");
    ids.push_back(static_cast<int32_t>(value));
    i = end;
  }
  return ids;
}

int tokenize_command(const std::string& tokenizer_path, const std::string& file, bool add_bos) {
  const Tokenizer tokenizer = Tokenizer::from_file(tokenizer_path);
  std::string text;
  if (file == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    std::ifstream in(file, std::ios::binary);
    DSV4_CHECK(in, "--file: cannot open " + file);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::vector<int32_t> ids;
  if (add_bos) {
    DSV4_CHECK(tokenizer.bos_id().has_value(),
               "--add-bos: the tokenizer at " + tokenizer_path + " has no bos_token");
    ids.push_back(*tokenizer.bos_id());
  }
  const std::vector<int32_t> body = tokenizer.encode(text, false);
  ids.insert(ids.end(), body.begin(), body.end());
  std::string line = "[";  // one JSON array
  for (size_t k = 0; k < ids.size(); ++k) {
    if (k) line += ',';
    line += std::to_string(ids[k]);
  }
  line += "]\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  return 0;
}

int detokenize_command(const std::string& tokenizer_path, const std::string& ids) {
  const Tokenizer tokenizer = Tokenizer::from_file(tokenizer_path);
  const std::vector<int32_t> parsed = parse_token_ids(ids);
  const std::string text = tokenizer.decode(parsed, false);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace dsv4
