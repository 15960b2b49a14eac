#include "lora/cli.h"

#include <climits>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lora/adapter.h"
#include "lora/convert.h"
#include "nlohmann/json.hpp"

namespace moelora {
namespace {

constexpr char kUsage[] =
    R"(moelora-adapter: inspect, convert and validate PEFT LoRA adapters for MoE models.

Usage:
  moelora-adapter inspect DIR [--json] [--model MODEL_DIR] [--max-lora-rank N]
      Format (2d | 3d | dense), rank(s), alpha, scaling, target modules, layers, experts,
      tensors and bytes of the adapter in DIR.
  moelora-adapter convert DIR --to 2d|3d --out OUT [--arch ARCH | --model MODEL_DIR]
      Writes the adapter to OUT in the requested MoE layout (adapter_config.json +
      adapter_model.safetensors). 3d->2d follows vLLM's conversion; --arch GptOssForCausalLM
      (or a GPT-OSS --model) selects the interleaved gate/up rows.
  moelora-adapter validate DIR --model MODEL_DIR [--max-lora-rank N]
      Checks the adapter against the base model's config.json: hidden size, expert
      intermediate size, number of experts and layers, target module shapes.
  moelora-adapter --help

DIR is a PEFT adapter directory (adapter_config.json + adapter_model.safetensors; pickle
files are never read).

Exit status: 0 success; 2 invalid adapter (the message names file, tensor and shape);
1 any other failure (usage, missing path, I/O).
)";

struct Args {
  std::string command;
  std::string dir;
  bool json = false;
  std::string model;
  std::string to;
  std::string out;
  std::string arch;
  int max_rank = 0;
};

int ExitFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
      return kExitOk;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kFailedPrecondition:
      return kExitInvalidAdapter;
    default:
      return kExitFailure;
  }
}

// Hand-rolled: the tool has sub-commands with positional arguments, which absl::flags (global
// flags) does not model; the grammar is small enough to parse here.
bool ParseArgs(const std::vector<std::string>& args, Args* a, std::string* error) {
  if (args.empty()) {
    *error = "missing command";
    return false;
  }
  a->command = args[0];
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& x = args[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= args.size()) {
        *error = x + " needs a value";
        return false;
      }
      *out = args[++i];
      return true;
    };
    if (x == "--json") {
      a->json = true;
    } else if (x == "--model") {
      if (!value(&a->model)) return false;
    } else if (x == "--to") {
      if (!value(&a->to)) return false;
    } else if (x == "--out") {
      if (!value(&a->out)) return false;
    } else if (x == "--arch") {
      if (!value(&a->arch)) return false;
    } else if (x == "--max-lora-rank") {
      std::string v;
      if (!value(&v)) return false;
      if (!absl::SimpleAtoi(v, &a->max_rank) || a->max_rank < 0) {
        *error = "--max-lora-rank needs a non-negative integer, got '" + v + "'";
        return false;
      }
    } else if (!x.empty() && x[0] == '-') {
      *error = "unknown option " + x;
      return false;
    } else if (a->dir.empty()) {
      a->dir = x;
    } else {
      *error = "unexpected argument " + x;
      return false;
    }
  }
  if (a->dir.empty()) {
    *error = a->command + " needs an adapter directory";
    return false;
  }
  return true;
}

nlohmann::json Describe(const LoraAdapter& ad) {
  nlohmann::json j;
  j["format"] = AdapterFormatName(ad.format);
  j["converted_to_2d"] = ad.converted_to_2d;
  j["rank"] = ad.config.r;
  j["lora_alpha"] = ad.config.lora_alpha;
  j["use_rslora"] = ad.config.use_rslora;
  j["scaling"] = ad.config.ScalingFor(ad.config.r, ad.config.lora_alpha);
  j["num_experts"] = ad.num_experts;
  j["num_experts_inferred"] = ad.num_experts_inferred;
  j["target_modules"] = ad.TargetModules();
  j["num_tensors"] = ad.num_tensors();
  j["bytes"] = ad.bytes;
  j["max_rank"] = ad.max_rank;
  std::set<int> ranks, layers;
  std::set<std::string> dtypes;
  auto visit = [&](const LoraPair& p) {
    ranks.insert(p.rank);
    dtypes.insert(std::string(DTypeName(p.a.dtype)));
  };
  for (const auto& [m, p] : ad.dense) {
    visit(p);
    auto cls = ClassifyModule(m);
    if (cls.layer >= 0) layers.insert(cls.layer);
  }
  for (const auto& [prefix, layer] : ad.moe) {
    if (layer.layer >= 0) layers.insert(layer.layer);
    if (layer.gate_up) visit(*layer.gate_up);
    if (layer.down) visit(*layer.down);
    for (const auto& ex : layer.experts) {
      for (const auto& p : ex) {
        if (p) visit(*p);
      }
    }
  }
  j["ranks"] = std::vector<int>(ranks.begin(), ranks.end());
  j["layers"] = std::vector<int>(layers.begin(), layers.end());
  j["num_layers"] = layers.size();
  j["num_moe_layers"] = ad.moe.size();
  j["dtypes"] = std::vector<std::string>(dtypes.begin(), dtypes.end());
  j["base_model_name_or_path"] = ad.config.base_model_name_or_path;
  j["notes"] = ad.notes;
  return j;
}

void PrintHuman(const nlohmann::json& j, const std::string& dir, std::ostream& out) {
  out << "adapter        " << dir << "\n";
  out << "format         " << j["format"].get<std::string>()
      << (j["converted_to_2d"].get<bool>() ? " (converted to 2d)" : "") << "\n";
  out << "rank           " << j["rank"] << " (per-module ranks " << j["ranks"].dump() << ")\n";
  out << "lora_alpha     " << j["lora_alpha"] << (j["use_rslora"].get<bool>() ? " (rsLoRA)" : "")
      << "\n";
  out << "scaling        " << j["scaling"] << "\n";
  out << "experts        " << j["num_experts"]
      << (j["num_experts_inferred"].get<bool>() ? " (inferred)" : "") << "\n";
  out << "layers         " << j["num_layers"] << " (" << j["num_moe_layers"]
      << " with expert LoRA)\n";
  out << "target_modules " << j["target_modules"].dump() << "\n";
  out << "tensors        " << j["num_tensors"] << "\n";
  out << "bytes          " << j["bytes"] << "\n";
  out << "dtypes         " << j["dtypes"].dump() << "\n";
  for (const auto& n : j["notes"]) out << "note           " << n.get<std::string>() << "\n";
}

int Fail(const absl::Status& s, std::ostream& err) {
  err << "moelora-adapter: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  return ExitFor(s);
}

}  // namespace

int RunAdapterCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h" || args[0] == "help")) {
    out << kUsage;
    return kExitOk;
  }
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      out << kUsage;
      return kExitOk;
    }
  }
  Args a;
  std::string error;
  if (!ParseArgs(args, &a, &error)) {
    err << "moelora-adapter: " << error << "\n\n" << kUsage;
    return kExitFailure;
  }
  AdapterReadOptions opt;
  opt.max_rank = a.max_rank;
  opt.arch = a.arch;
  if (!a.model.empty()) {
    auto info = ReadModelInfo(a.model);
    if (!info.ok()) {
      err << "moelora-adapter: model: " << info.status().message() << "\n";
      return kExitFailure;
    }
    opt.model = *info;
  }
  if (a.command == "inspect") {
    auto ad = ReadAdapter(a.dir, opt);
    if (!ad.ok()) return Fail(ad.status(), err);
    nlohmann::json j = Describe(*ad);
    if (a.json) {
      out << j.dump(2) << "\n";
    } else {
      PrintHuman(j, a.dir, out);
    }
    return kExitOk;
  }
  if (a.command == "validate") {
    if (a.model.empty()) {
      err << "moelora-adapter: validate needs --model MODEL_DIR\n";
      return kExitFailure;
    }
    auto ad = ReadAdapter(a.dir, opt);
    if (!ad.ok()) return Fail(ad.status(), err);
    out << "OK: " << a.dir << " is a valid " << AdapterFormatName(ad->format) << " adapter for "
        << opt.model->architecture << " (" << ad->num_tensors() << " tensors, " << ad->num_experts
        << " experts, max rank " << ad->max_rank << ")\n";
    return kExitOk;
  }
  if (a.command == "convert") {
    if (a.to != "2d" && a.to != "3d") {
      err << "moelora-adapter: convert needs --to 2d or --to 3d\n";
      return kExitFailure;
    }
    if (a.out.empty()) {
      err << "moelora-adapter: convert needs --out OUT\n";
      return kExitFailure;
    }
    char real_in[PATH_MAX], real_out[PATH_MAX];
    if (realpath(a.dir.c_str(), real_in) && realpath(a.out.c_str(), real_out) &&
        std::string(real_in) == std::string(real_out)) {
      err << "moelora-adapter: --out must differ from the input directory\n";
      return kExitFailure;
    }
    auto ad = ReadAdapter(a.dir, opt);
    if (!ad.ok()) return Fail(ad.status(), err);
    if (ad->format == AdapterFormat::kDense) {
      err << "moelora-adapter: note: dense adapter (no expert LoRA); written unchanged\n";
    }
    absl::Status s = a.to == "2d" ? ConvertTo2DInPlace(&*ad) : ConvertTo3D(&*ad);
    if (!s.ok()) return Fail(s, err);
    s = WriteAdapter(*ad, a.out);
    if (!s.ok()) return Fail(absl::Status(absl::StatusCode::kInternal, s.message()), err);
    out << "wrote " << a.out << " (" << a.to << ", " << ad->num_tensors() << " tensors)\n";
    return kExitOk;
  }
  err << "moelora-adapter: unknown command '" << a.command << "'\n\n" << kUsage;
  return kExitFailure;
}

}  // namespace moelora
