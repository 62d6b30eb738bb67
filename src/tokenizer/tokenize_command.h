// `dsv4 tokenize` / `dsv4 detokenize` (wired into src/cli by the CLI owner). Both throw dsv4::Error on bad
// input (the CLI's main prints it and exits 1) and return the process exit code otherwise.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

// Encodes the bytes of `file` ("-" = stdin) with the tokenizer at `tokenizer_path` (tokenizer.json or a model
// directory) and prints the ids on one line, comma-separated (the format `--ids` takes). `add_bos` prepends
// the BOS id of tokenizer_config.json (an error when the tokenizer has none).
int tokenize_command(const std::string& tokenizer_path, const std::string& file, bool add_bos);

// Decodes `ids` ("5,17,3"; commas and/or whitespace separate) and prints the text, with no added newline.
int detokenize_command(const std::string& tokenizer_path, const std::string& ids);

// "5, 17 3" -> {5, 17, 3}; throws dsv4::Error on anything that is not an int32 list.
std::vector<int32_t> parse_token_ids(const std::string& text);

}  // namespace dsv4
