// The multimodal fixtures (tools/make_vision_fixtures.py): prompts with image pads, the images
// they show, the rows of logits kept, and the images prepared as the controller prepares them.
#ifndef MOELORA_TESTS_UNIT_WORKER_MM_FIXTURE_H_
#define MOELORA_TESTS_UNIT_WORKER_MM_FIXTURE_H_

#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/unit/worker/engine_test_util.h"
#include "vision/image_processor.h"
#include "worker/engine/engine.h"

namespace moelora::testing {

struct MmPrompt {
  std::vector<int32_t> ids;
  std::vector<std::string> images;                   // file names under images/
  std::vector<int64_t> rows;                         // the rows whose logits the fixture keeps
  std::vector<float> pixel_values;                   // the processor's, all images
  std::map<std::string, std::vector<float>> logits;  // variant -> [rows, V]
  std::map<std::string, std::vector<int32_t>> continuation;  // variant -> greedy tokens
};

inline std::vector<MmPrompt> ReadMm(const std::string& fixture) {
  std::vector<MmPrompt> out;
  auto f = SafetensorsFile::Open(Data(fixture + "/expected_logits.safetensors"));
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return out;
  auto vec = [&](const std::string& name, auto* dst) {
    const TensorView* t = (*f)->Find(name);
    if (t == nullptr) return false;
    dst->resize(t->nbytes / sizeof((*dst)[0]));
    std::memcpy(dst->data(), t->data, t->nbytes);
    return true;
  };
  for (int k = 0;; ++k) {
    MmPrompt p;
    if (!vec(absl::StrCat("prompt.", k), &p.ids)) break;
    vec(absl::StrCat("rows.", k), &p.rows);
    vec(absl::StrCat("pixel_values.", k), &p.pixel_values);
    for (const char* v : {"base", "adapter_3d", "adapter_2d"}) {
      vec(absl::StrCat("logits.", v, ".", k), &p.logits[v]);
      vec(absl::StrCat("continuation.", v, ".", k), &p.continuation[v]);
    }
    for (const auto& n : nlohmann::json::parse((*f)->metadata().at(absl::StrCat("images.", k)))) {
      p.images.push_back(n.get<std::string>());
    }
    out.push_back(std::move(p));
  }
  return out;
}

inline std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The engine's images for a prompt, prepared as the controller prepares them.
inline std::vector<ImageInput> Images(const std::string& fixture, const MmPrompt& p) {
  auto cfg = vision::ImageProcessorConfig::Load(Data(fixture + "/model"));
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  std::vector<ImageInput> out;
  const int32_t pad = nlohmann::json::parse(ReadBytes(Data(fixture + "/model/config.json")))
                          .at("image_token_id")
                          .get<int32_t>();
  int64_t at = 0;
  for (const std::string& name : p.images) {
    auto im = vision::ProcessImage(ReadBytes(Data(fixture + "/images/" + name)), *cfg);
    EXPECT_TRUE(im.ok()) << im.status();
    const int64_t tokens = im->tokens(cfg->merge_size);
    while (at < static_cast<int64_t>(p.ids.size()) && p.ids[at] != pad) ++at;
    ImageInput in;
    in.offset = at;
    in.height = im->pixels.height;
    in.width = im->pixels.width;
    in.rgb.assign(im->pixels.rgb.begin(), im->pixels.rgb.end());
    out.push_back(std::move(in));
    at += tokens;
  }
  return out;
}

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_UNIT_WORKER_MM_FIXTURE_H_
