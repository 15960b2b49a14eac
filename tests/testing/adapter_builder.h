// Writes small synthetic PEFT adapter directories for tests (random F32/BF16 values, fixed seed).
#ifndef MOELORA_TESTS_TESTING_ADAPTER_BUILDER_H_
#define MOELORA_TESTS_TESTING_ADAPTER_BUILDER_H_

#include <sys/stat.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace moelora::testing {

class AdapterBuilder {
 public:
  explicit AdapterBuilder(uint32_t seed = 7) : rng_(seed) {
    config_ = {{"peft_type", "LORA"},          {"r", 2},         {"lora_alpha", 4},
               {"target_modules", {"q_proj"}}, {"bias", "none"}, {"use_dora", false},
               {"modules_to_save", nullptr}};
  }
  nlohmann::json& config() { return config_; }

  // Adds "base_model.model.<module>.<suffix>" of the given shape with random values.
  AdapterBuilder& Tensor(const std::string& name, std::vector<int64_t> shape,
                         DType dtype = DType::kF32) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<uint8_t> bytes(static_cast<size_t>(n) * DTypeBits(dtype) / 8);
    std::normal_distribution<float> dist(0.0f, 0.5f);
    for (int64_t i = 0; i < n; ++i) StoreFromF32(dtype, bytes.data(), i, dist(rng_));
    tensors_.push_back({name, dtype, std::move(shape), std::move(bytes)});
    return *this;
  }
  // Sets element `i` of the tensor named `name` (added before) to `value`.
  AdapterBuilder& Poke(const std::string& name, int64_t i, float value) {
    for (auto& t : tensors_) {
      if (t.name == name) StoreFromF32(t.dtype, t.bytes.data(), i, value);
    }
    return *this;
  }
  AdapterBuilder& Pair(const std::string& module, int64_t r, int64_t in, int64_t out,
                       DType dtype = DType::kF32) {
    Tensor("base_model.model." + module + ".lora_A.weight", {r, in}, dtype);
    return Tensor("base_model.model." + module + ".lora_B.weight", {out, r}, dtype);
  }
  // A 2D expert layer: E experts x {gate, up, down}.
  AdapterBuilder& Experts2D(const std::string& prefix, int64_t e_count, int64_t r, int64_t h,
                            int64_t inter) {
    for (int64_t e = 0; e < e_count; ++e) {
      const std::string p = prefix + "." + std::to_string(e);
      Pair(p + ".gate_proj", r, h, inter);
      Pair(p + ".up_proj", r, h, inter);
      Pair(p + ".down_proj", r, inter, h);
    }
    return *this;
  }
  // A 3D expert layer (PEFT target_parameters layout).
  AdapterBuilder& Experts3D(const std::string& prefix, int64_t e_count, int64_t r, int64_t h,
                            int64_t inter, DType dtype = DType::kF32) {
    Tensor("base_model.model." + prefix + ".base_layer.lora_A.weight", {e_count * r, h}, dtype);
    Tensor("base_model.model." + prefix + ".base_layer.lora_B.weight", {2 * inter, r * e_count},
           dtype);
    Tensor("base_model.model." + prefix + ".lora_A.weight", {e_count * r, inter}, dtype);
    return Tensor("base_model.model." + prefix + ".lora_B.weight", {h, r * e_count}, dtype);
  }
  // Writes DIR/adapter_config.json and DIR/adapter_model.safetensors; returns DIR.
  std::string Write(const std::string& dir) const {
    ::mkdir(dir.c_str(), 0755);
    WriteFile(dir + "/adapter_config.json", config_.dump(2));
    std::vector<TensorToWrite> ts;
    for (const auto& t : tensors_)
      ts.push_back({t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size()});
    auto s = WriteSafetensors(dir + "/adapter_model.safetensors", ts);
    if (!s.ok()) throw std::runtime_error(s.ToString());
    return dir;
  }

 private:
  struct T {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::mt19937 rng_;
  nlohmann::json config_;
  std::vector<T> tensors_;
};

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_TESTING_ADAPTER_BUILDER_H_
