// Greedy continuations by llama.cpp, for bench/peer's output comparison (test-only: built by
// tools/llama_cpp_peer.sh against the llama.cpp it builds; the product never links llama.cpp).
//   llama_greedy MODEL.gguf NEW_TOKENS THREADS < prompts
// Each stdin line is one prompt's token ids (space-separated); each stdout line the NEW_TOKENS
// ids llama.cpp picks by argmax after it, prompts one at a time from an empty context.
// Written here because llama.cpp's own tools take text prompts, and our bench models carry no
// tokenizer.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: llama_greedy MODEL.gguf NEW_TOKENS THREADS < prompts\n");
    return 2;
  }
  const int n_new = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", argv[1]);
    return 1;
  }
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 4096;
  cp.n_batch = 4096;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "cannot create a context\n");
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<llama_token> tokens;
    std::istringstream in(line);
    for (llama_token t; in >> t;) tokens.push_back(t);
    if (tokens.empty()) continue;
    llama_memory_clear(llama_get_memory(ctx), true);
    std::vector<llama_token> out;
    llama_batch batch = llama_batch_get_one(tokens.data(), static_cast<int32_t>(tokens.size()));
    for (int i = 0; i < n_new; ++i) {
      if (llama_decode(ctx, batch) != 0) {
        std::fprintf(stderr, "llama_decode failed\n");
        return 1;
      }
      const float* logits = llama_get_logits_ith(ctx, -1);
      llama_token best = 0;
      for (int v = 1; v < vocab; ++v) {
        if (logits[v] > logits[best]) best = v;
      }
      out.push_back(best);
      batch = llama_batch_get_one(&out.back(), 1);
    }
    for (size_t i = 0; i < out.size(); ++i) std::printf(i ? " %d" : "%d", out[i]);
    std::printf("\n");
    std::fflush(stdout);
  }
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
