// vision_encoder: the vision tower's time for one image against transformers' vision forward on
// the same weights, image and threads (float32), medians of runs made back to back.
//
//   vision_encoder [--python PY] [--dir DIR] [--threads N] [--runs R] [--images 448,1344]
//                  [--dtype float32|bfloat16]
//
// DIR (default .cache/vision-bench) holds a Qwen3-VL-MoE checkpoint whose tower has the released
// 30B-A3B's dimensions with fewer blocks (tools/vision_bench.py make, run once: --depth there),
// and the test images. PY (default .cache/peer-venv/bin/python) runs tools/vision_bench.py run.
// Prints per image: patches, moelora's median, transformers' median, and the ratio (> 1: faster);
// then the image's arithmetic (the tower's products, counted from its config) and each side's
// rate against the rate this CPU's multiply-add instruction reaches on `threads` threads
// (compute_peak.h): the ratio the goal asks for cannot exceed peak / transformers' rate.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_args.h"
#include "bench/compute_peak.h"
#include "nlohmann/json.hpp"
#include "vision/image_processor.h"
#include "worker/architectures/vision_tower.h"
#include "worker/comm/communicator.h"
#include "worker/layers/gemm.h"
#include "worker/model/causal_lm.h"

namespace {

using moelora::bench::Capture;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The tower's multiply-adds (× 2) for one frame of n patches: patch embedding, each block's
// qkv / proj / fc1 / fc2 and attention (q·k and p·v over the frame), the final merger and each
// DeepStack merger (merge² patches into one row: fc1 square, fc2 to the LM width). Norms,
// activations and the rotary are left out (under 1 %).
double TowerGflop(const moelora::VisionConfig& v, double n) {
  const double D = v.hidden_size, I = v.intermediate_size, P = static_cast<double>(v.patch_dim());
  const double mm = v.spatial_merge_size * v.spatial_merge_size, Hm = D * mm;
  const double block = 2 * n * (D * 3 * D + D * D + 2 * D * I) + 4 * n * n * D;
  const double merger = 2 * (n / mm) * (Hm * Hm + Hm * v.out_hidden_size);
  const double mergers = 1.0 + static_cast<double>(v.deepstack_visual_indexes.size());
  return (2 * n * P * D + v.depth * block + mergers * merger) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moelora;  // NOLINT
  const std::string src = MOELORA_SOURCE_DIR;
  std::string python = src + "/.cache/peer-venv/bin/python", dir = src + "/.cache/vision-bench";
  int threads = 2, runs = 3;
  std::string dtype = "float32";
  std::vector<int> images = {448, 1344};
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (f == "--python") {
      python = value();
    } else if (f == "--dir") {
      dir = value();
    } else if (f == "--threads") {
      threads = std::stoi(value());
    } else if (f == "--dtype") {
      dtype = value();
    } else if (f == "--runs") {
      runs = std::stoi(value());
    } else if (f == "--images") {
      images.clear();
      for (absl::string_view s : absl::StrSplit(value(), ','))
        images.push_back(std::stoi(std::string(s)));
    } else {
      std::fprintf(stderr,
                   "usage: vision_encoder [--python PY] [--dir DIR] [--threads N] [--runs R] "
                   "[--images 448,1344] [--dtype float32|bfloat16]\n");
      return f == "--help" ? 0 : 2;
    }
  }
  const std::string script = src + "/tools/vision_bench.py";
  if (!std::filesystem::exists(dir + "/model/config.json")) {
    std::printf("making %s (tools/vision_bench.py make)\n", dir.c_str());
    if (Capture(absl::StrCat(python, " ", script, " make --out ", dir, " 2>&1")).empty() &&
        !std::filesystem::exists(dir + "/model/config.json")) {
      return 1;
    }
  }
  at::set_num_threads(threads);
  auto comm = MakeLocalCommunicator();
  ModelOptions o;
  o.dtype = dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  auto m = LoadCausalLM(dir + "/model", o, comm.get());
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", std::string(m.status().message()).c_str());
    return 1;
  }
  auto cfg = vision::ImageProcessorConfig::Load(dir + "/model");
  if (!cfg.ok()) return 1;
  bool slow_blas = false;
  const std::string blas = BlasDescription(&slow_blas);
  if (!blas.empty()) {
    std::printf("BLAS: %s%s\n", blas.c_str(),
                slow_blas ? ": below this CPU's instruction set (env -u OPENBLAS_CORETYPE)" : "");
  }
  std::printf("vision tower: %d blocks of %d, threads %d, %s, %d runs each (median)\n",
              (*m)->vision()->depth, (*m)->vision()->hidden_size, threads, dtype.c_str(), runs);
  const double peak = ComputePeakGflops(threads, dtype == "bfloat16");
  std::printf("this CPU's %s peak on %d threads: %.0f GFLOP/s\n",
              peak::Instruction(dtype == "bfloat16") ? peak::Instruction(dtype == "bfloat16") : "-",
              threads, peak);
  std::printf("%-7s %8s %12s %14s %7s %8s %16s %9s\n", "image", "patches", "moelora s",
              "transformers s", "ratio", "GFLOP", "GFLOP/s us/them", "bound");
  for (int side : images) {
    std::ifstream in(absl::StrCat(dir, "/images/", side, ".png"), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    auto im = vision::ProcessImage(ss.str(), *cfg);
    if (!im.ok()) return 1;
    std::vector<float> px = vision::PixelValues(*im, *cfg);
    VisionImage vi;
    vi.pixel_values = at::from_blob(px.data(), {im->patches(), cfg->patch_dim()}, at::kFloat);
    vi.grid_h = im->grid_h;
    vi.grid_w = im->grid_w;
    std::vector<double> t;
    for (int r = 0; r <= runs; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      auto e = (*m)->EncodeImages({vi});
      if (!e.ok()) {
        std::fprintf(stderr, "%s\n", std::string(e.status().message()).c_str());
        return 1;
      }
      if (r > 0) {
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    const std::string peer = Capture(
        absl::StrCat(python, " ", script, " run --dir ", dir, " --threads ", threads, " --runs ",
                     runs, " --image ", side, " --dtype ", dtype, " 2>/dev/null"));
    double theirs = 0;
    for (absl::string_view line : absl::StrSplit(peer, '\n')) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.is_object() && j.contains("median")) theirs = j["median"];
    }
    const double ours = Median(t);
    const double gflop = TowerGflop(*(*m)->vision(), static_cast<double>(im->patches()));
    // bound: the ratio a tower running at this CPU's peak would reach against transformers.
    std::printf("%4dx%-4d %6lld %12.3f %14.3f %7.2f %8.1f %7.0f / %-7.0f %9.2f\n", side, side,
                static_cast<long long>(im->patches()), ours, theirs,
                ours > 0 && theirs > 0 ? theirs / ours : 0.0, gflop, ours > 0 ? gflop / ours : 0,
                theirs > 0 ? gflop / theirs : 0,
                theirs > 0 && peak > 0 ? theirs * peak / gflop : 0);
    std::fflush(stdout);
  }
  return 0;
}
