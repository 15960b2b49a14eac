// bench/adapter_load: load + validate + convert (3D -> 2D, in place) a 3D MoE LoRA adapter of
// real size, against a plain memcpy of the same bytes measured in the same run.
//
//   adapter_load [--layers N] [--dir DIR] [--repeat K]
//
// Qwen3-30B-A3B dimensions: H=2048, I=768, E=128, r=16, bf16, 48 layers (about 1.26 GB of expert
// LoRA). The adapter is written to DIR (default /tmp), read back through lora::ReadAdapter, and
// the best of K runs is reported: GB/s of the load vs GB/s of memcpy, their ratio (goal >= 0.5),
// and the peak extra resident memory beyond the adapter itself (goal <= 10% of its size).
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/safetensors.h"
#include "lora/adapter.h"

namespace {

constexpr int64_t kH = 2048, kI = 768, kE = 128, kR = 16;

// Resident set and its high-water mark, in bytes (from /proc/self/status).
int64_t ProcStatusBytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(in, line)) {
    if (line.compare(0, n, key) == 0) return std::atoll(line.c_str() + n + 1) * 1024;
  }
  return -1;
}

void ResetPeak() {
  std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current RSS
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Cheap deterministic bf16 values (the bench measures bytes, not numerics).
void Fill(uint16_t* p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = static_cast<uint16_t>(0x3c00 | (x & 0x03ff));  // small positive bf16 values
  }
}

std::string WriteAdapterDir(const std::string& dir, int layers, size_t* bytes) {
  ::mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/adapter_config.json")
      << R"({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": [],)"
      << R"( "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], "bias": "none"})";
  struct Owned {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<uint16_t> data;
  };
  std::vector<Owned> owned;
  for (int l = 0; l < layers; ++l) {
    const std::string p = "base_model.model.model.layers." + std::to_string(l) + ".mlp.experts";
    owned.push_back({p + ".base_layer.lora_A.weight", {kE * kR, kH}, {}});
    owned.push_back({p + ".base_layer.lora_B.weight", {2 * kI, kR * kE}, {}});
    owned.push_back({p + ".lora_A.weight", {kE * kR, kI}, {}});
    owned.push_back({p + ".lora_B.weight", {kH, kR * kE}, {}});
  }
  std::vector<moelora::TensorToWrite> ts;
  *bytes = 0;
  uint32_t seed = 1;
  for (auto& o : owned) {
    o.data.resize(static_cast<size_t>(o.shape[0] * o.shape[1]));
    Fill(o.data.data(), o.data.size(), seed++);
    ts.push_back({o.name, moelora::DType::kBF16, o.shape, o.data.data(), o.data.size() * 2});
    *bytes += o.data.size() * 2;
  }
  auto s = moelora::WriteSafetensors(dir + "/adapter_model.safetensors", ts);
  if (!s.ok()) {
    std::fprintf(stderr, "write failed: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  return dir;
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 48, repeat = 3;
  std::string base = "/tmp";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if ((a == "--layers" || a == "--repeat") && i + 1 < argc) {
      int v = 0;
      if (!absl::SimpleAtoi(argv[++i], &v) || v <= 0) {
        std::fprintf(stderr, "%s needs a positive integer\n", a.c_str());
        return 1;
      }
      (a == "--layers" ? layers : repeat) = v;
    } else if (a == "--dir" && i + 1 < argc) {
      base = argv[++i];
    } else if (a == "--help" || a == "-h") {
      std::printf("usage: adapter_load [--layers N (48)] [--repeat K (3)] [--dir DIR (/tmp)]\n");
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s (see --help)\n", a.c_str());
      return 1;
    }
  }
  const std::string dir = base + "/moelora_bench_adapter_" + std::to_string(::getpid());
  size_t bytes = 0;
  WriteAdapterDir(dir, layers, &bytes);
  const double gb = bytes / 1e9;
  std::printf("adapter: %d layers, H=%lld I=%lld E=%lld r=%lld bf16, %.3f GB (3D)\n", layers,
              static_cast<long long>(kH), static_cast<long long>(kI), static_cast<long long>(kE),
              static_cast<long long>(kR), gb);

  // Baseline: memcpy of the same bytes into freshly allocated memory (page faults included, as
  // the loader's destination buffers are fresh too).
  // Two baselines: into fresh memory (page faults included, as the loader's buffers are fresh)
  // and into already-touched memory (pure copy bandwidth, the stricter bound).
  double best_memcpy = 1e30, best_memcpy_warm = 1e30;
  {
    std::unique_ptr<uint8_t[]> src(new uint8_t[bytes]);
    std::memset(src.get(), 1, bytes);
    for (int k = 0; k < repeat; ++k) {
      std::unique_ptr<uint8_t[]> dst(new uint8_t[bytes]);
      double t0 = Now();
      std::memcpy(dst.get(), src.get(), bytes);
      best_memcpy = std::min(best_memcpy, Now() - t0);
      t0 = Now();
      std::memcpy(dst.get(), src.get(), bytes);
      best_memcpy_warm = std::min(best_memcpy_warm, Now() - t0);
      volatile uint8_t sink = dst[bytes / 2];
      (void)sink;
    }
  }

  double best_total = 1e30;
  moelora::AdapterLoadTimings best{};
  int64_t worst_extra = 0;
  for (int k = 0; k < repeat; ++k) {
    const int64_t rss0 = ProcStatusBytes("VmRSS:");
    ResetPeak();
    moelora::AdapterLoadTimings tm;
    moelora::AdapterReadOptions opt;
    opt.convert_to_2d = true;
    const double t0 = Now();
    auto ad = moelora::ReadAdapter(dir, opt, &tm);
    const double total = Now() - t0;
    if (!ad.ok()) {
      std::fprintf(stderr, "load failed: %s\n", ad.status().ToString().c_str());
      return 1;
    }
    const int64_t peak = ProcStatusBytes("VmHWM:");
    worst_extra = std::max<int64_t>(worst_extra, peak - rss0 - static_cast<int64_t>(ad->bytes));
    if (total < best_total) {
      best_total = total;
      best = tm;
    }
  }
  std::string cmd = "rm -rf '" + dir + "'";
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir.c_str());

  const double memcpy_gbs = gb / best_memcpy;
  const double load_gbs = gb / best_total;
  std::printf("\n%-34s %10s %10s\n", "phase (best of runs)", "seconds", "GB/s");
  std::printf("%-34s %10.3f %10.2f\n", "memcpy, fresh destination", best_memcpy, memcpy_gbs);
  std::printf("%-34s %10.3f %10.2f\n", "memcpy, warm destination", best_memcpy_warm,
              gb / best_memcpy_warm);
  std::printf("%-34s %10.3f %10.2f\n", "read (map + copy to host)", best.read, gb / best.read);
  std::printf("%-34s %10.3f %10s\n", "validate", best.validate, "-");
  std::printf("%-34s %10.3f %10.2f\n", "convert 3D->2D in place", best.convert, gb / best.convert);
  std::printf("%-34s %10.3f %10.2f\n", "load + validate + convert", best_total, load_gbs);
  std::printf(
      "\nratio load/memcpy bandwidth: %.2f vs fresh-destination memcpy, %.2f vs warm (goal >= "
      "0.5)\n",
      load_gbs / memcpy_gbs, load_gbs / (gb / best_memcpy_warm));
  std::printf("peak extra memory: %.1f MB = %.2f%% of the adapter (goal <= 10%%)\n",
              worst_extra / 1e6, 100.0 * worst_extra / static_cast<double>(bytes));
  return 0;
}
