// Tokenizer encode speed on the corpus that tools/make_tokenizers.py real wrote, on one core,
// next to Hugging Face tokenizers' one-thread figure that the script measured on the same corpus
// and machine (DIR/hf_speed.json). Usage: tokenizer_encode DIR [--repeat N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help") {
    std::cout
        << "usage: tokenizer_encode CORPUS_DIR [--repeat N]\n"
           "  CORPUS_DIR: written by tools/make_tokenizers.py real (qwen3/, qwen3_5/, "
           "corpus.jsonl,\n"
           "  hf_speed.json). Prints MB/s of Encode on one thread and the ratio to tokenizers'.\n";
    return argc < 2 ? 2 : 0;
  }
  const std::string dir = argv[1];
  int repeat = 3;
  if (argc >= 4 && std::string(argv[2]) == "--repeat") repeat = std::max(1, std::stoi(argv[3]));
  std::vector<std::string> texts;
  size_t bytes = 0;
  {
    std::ifstream in(dir + "/corpus.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      texts.push_back(nlohmann::json::parse(line)["text"].get<std::string>());
      bytes += texts.back().size();
    }
  }
  nlohmann::json hf;
  std::ifstream(dir + "/hf_speed.json") >> hf;
  std::printf("tokenizer encode, one thread, %zu strings, %.2f MB (best of %d)\n", texts.size(),
              bytes / 1e6, repeat);
  std::printf("%-8s %12s %12s %8s %10s\n", "vocab", "moelora", "tokenizers", "ratio", "load");
  for (const std::string name : {"qwen3", "qwen3_5"}) {
    const auto t0 = std::chrono::steady_clock::now();
    auto tok = moelora::tok::Tokenizer::Load(dir + "/" + name);
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!tok.ok()) {
      std::cerr << tok.status() << "\n";
      return 1;
    }
    double best = 1e30;
    size_t ids = 0;
    for (int r = 0; r < repeat; ++r) {
      ids = 0;
      const auto a = std::chrono::steady_clock::now();
      for (const std::string& t : texts) ids += (*tok)->Encode(t)->size();
      best = std::min(best,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
    }
    const double mbs = bytes / best / 1e6;
    const double hf_mbs = hf["mb_per_s"][name].get<double>();
    std::printf("%-8s %9.2f MB/s %7.2f MB/s %7.2fx %8.2f s   (%zu ids)\n", name.c_str(), mbs,
                hf_mbs, mbs / hf_mbs, load_s, ids);
  }
  return 0;
}
