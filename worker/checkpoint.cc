#include "worker/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace moelora {
namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat(dir, ": model directory does not exist"));
  }
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  ckpt->dir_ = dir;
  std::vector<std::string> shards;
  std::map<std::string, std::string> index_map;  // tensor -> shard file name
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (fs::exists(index_path, ec)) {
    std::ifstream in(index_path);
    std::stringstream ss;
    ss << in.rdbuf();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(ss.str());
    } catch (const nlohmann::json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": not valid JSON: ", e.what()));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": no \"weight_map\" object"));
    }
    std::set<std::string> unique;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map[\"", name, "\"] is not a file name"));
      }
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f == "..") {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": shard name \"", f, "\" leaves the model directory"));
      }
      index_map[name] = f;
      unique.insert(f);
    }
    shards.assign(unique.begin(), unique.end());
  } else if (fs::exists(dir + "/model.safetensors", ec)) {
    shards.push_back("model.safetensors");
  } else {
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (absl::EndsWith(name, ".safetensors")) shards.push_back(name);
    }
    std::sort(shards.begin(), shards.end());
    if (shards.empty()) {
      for (const char* pickle :
           {"pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json"}) {
        if (fs::exists(dir + "/" + pickle, ec)) {
          return absl::InvalidArgumentError(
              absl::StrCat(dir, ": only pickle weights (", pickle,
                           ") found; convert them to safetensors (pickle files are never opened)"));
        }
      }
      return absl::NotFoundError(absl::StrCat(dir, ": no *.safetensors weights"));
    }
  }
  for (const std::string& shard : shards) {
    const std::string path = dir + "/" + shard;
    if (!fs::exists(path, ec)) {
      return absl::NotFoundError(
          absl::StrCat(path, ": shard named by model.safetensors.index.json is missing"));
    }
    MOELORA_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
    for (const TensorView& view : file->tensors()) {
      auto [it, inserted] = ckpt->tensors_.emplace(view.name, &view);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", view.name, " is in both ",
                                                       ckpt->file_of_[view.name], " and ", path));
      }
      ckpt->file_of_[view.name] = path;
    }
    ckpt->files_.push_back(std::move(file));
  }
  for (const auto& [name, shard] : index_map) {
    auto it = ckpt->file_of_.find(name);
    if (it == ckpt->file_of_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          index_path, ": tensor ", name, " is listed in ", shard, " but that shard lacks it"));
    }
  }
  return ckpt;
}

absl::Status Checkpoint::CheckIntact() const {
  for (const auto& f : files_) MOELORA_RETURN_IF_ERROR(f->CheckIntact());
  return absl::OkStatus();
}

}  // namespace moelora
