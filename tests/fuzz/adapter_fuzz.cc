// libFuzzer harness: arbitrary bytes as adapter_model.safetensors of an adapter directory (the
// whole input is the file, so fixture files are valid seeds; the config and options are chosen
// from the input's size), read, validated and — when valid and 3D — converted to 2D
// and back. Never a crash; errors are statuses.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "lora/adapter.h"
#include "lora/convert.h"

namespace {

const std::string& Dir() {
  static const std::string dir = [] {
    std::string tmpl = "/tmp/moelora_adapter_fuzz_XXXXXX";
    return std::string(mkdtemp(tmpl.data()));
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* kConfigs[] = {
      R"({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]})",
      R"({"r": 3, "lora_alpha": 6, "target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]})",
      R"({"r": 2, "lora_alpha": 2, "use_rslora": true, "target_modules": ".*", "rank_pattern": {"q_proj": 1}})",
      R"({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})",
  };
  const std::string dir = Dir();
  std::ofstream(dir + "/adapter_config.json", std::ios::trunc) << kConfigs[size % 4];
  {
    std::ofstream out(dir + "/adapter_model.safetensors", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  moelora::AdapterReadOptions opt;
  opt.max_rank = 64;
  opt.convert_to_2d = (size / 4) % 2 == 0;
  opt.arch = (size / 8) % 2 ? "GptOssForCausalLM" : "";
  auto a = moelora::ReadAdapter(dir, opt);
  if (!a.ok()) {
    auto c = a.status().code();
    if (c != absl::StatusCode::kInvalidArgument && c != absl::StatusCode::kResourceExhausted)
      std::abort();
    return 0;
  }
  moelora::ConvertTo2DInPlace(&*a).IgnoreError();
  moelora::ConvertTo3D(&*a).IgnoreError();
  return 0;
}
