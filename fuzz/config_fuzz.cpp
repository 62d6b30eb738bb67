// libFuzzer target: config.json text -> ModelConfig. Any input must either parse into a validated config or
// throw dsv4::Error / a JSON parse error; anything else (a crash, another exception) is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;
  }
  try {
    const dsv4::ModelConfig config = dsv4::ModelConfig::from_json(json);
    // A config that parsed must be usable: its rope tables and its own serialisation.
    (void)config.inv_freq(dsv4::RopeKind::kMain);
    (void)config.inv_freq(dsv4::RopeKind::kCompress);
    (void)dsv4::ModelConfig::from_json(config.to_json());
  } catch (const dsv4::Error&) {
  }
  return 0;
}
