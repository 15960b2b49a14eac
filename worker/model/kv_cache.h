// The paged KV cache of one worker (one tensor-parallel rank): fixed-size blocks of
// `block_size` token positions from one pool, sized by a memory budget. Every attention layer
// has its own K and V pool tensors ([num_blocks, block_size, kv_heads, head_dim] in the model's
// dtype, on the model's device); a sequence holds one block table that serves every layer
// (block b of the table holds positions b · block_size .. (b + 1) · block_size - 1 in each
// layer's pool). Pages of the pools are touched only when written, and a block never used is
// taken only when no freed or cached block is left, so memory grows to the budget only as far as
// the sequences (and the prefix cache within what they touched) need it.
//
// Thread-safety: Reserve and Release on the engine's compute thread only; the counts may be
// read from any thread.
#ifndef MOELORA_WORKER_MODEL_KV_CACHE_H_
#define MOELORA_WORKER_MODEL_KV_CACHE_H_

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace moelora {

struct KvLayerShape {
  int layer = 0;                       // decoder layer index
  int64_t kv_heads = 0, head_dim = 0;  // on this rank
};

struct KvCacheOptions {
  int64_t block_size = 16;                  // --block-size
  int64_t memory_bytes = int64_t{4} << 30;  // --kv-cache-memory-bytes
  // At most this many blocks (0: no bound): no more than the sequences could ever fill.
  int64_t max_blocks = 0;
};

class KvCache {
 public:
  // num_layers: decoder layers in all (the attention ones are in `layers`). INVALID_ARGUMENT
  // when the budget holds no block, naming the bytes one block needs.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvCache>> Create(
      const std::vector<KvLayerShape>& layers, int num_layers, const KvCacheOptions& o,
      at::ScalarType dtype, const at::Device& device);

  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t free_blocks() const { return free_count_.load(std::memory_order_relaxed); }
  // Bytes of one block over every attention layer (K and V).
  int64_t bytes_per_block() const { return bytes_per_block_; }
  // Blocks `tokens` positions take.
  int64_t BlocksFor(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // Grows `table` to cover positions 0 .. tokens - 1. False, with `table` unchanged, when the
  // pool has too few free blocks (cached blocks nobody holds count as free: the least recently
  // used are evicted).
  [[nodiscard]] bool Reserve(std::vector<int32_t>& table, int64_t tokens);
  // Returns every block of `table` to the pool (a cached one stays cached until evicted) and
  // clears it.
  void Release(std::vector<int32_t>& table);

  // Prefix caching. A full block is keyed by (the adapter, the key of the block before it, its
  // tokens), so a prefix is shared only under the same adapter (0: the base model).
  // Match appends to the empty `table` the cached blocks that hold the longest prefix of
  // `tokens` in whole blocks, leaving at least one token to compute, and returns how many tokens
  // they hold; `hashes` gets their keys.
  int64_t Match(int64_t adapter, const std::vector<int32_t>& tokens, std::vector<int32_t>& table,
                std::vector<uint64_t>& hashes);
  // Makes the full blocks of `table` among positions 0 .. len - 1 (tokens[p] at position p)
  // that `hashes` does not cover yet findable by Match, extending `hashes`. A block whose key is
  // cached already (another copy) stays private.
  void Publish(int64_t adapter, const std::vector<int32_t>& tokens, int64_t len,
               const std::vector<int32_t>& table, std::vector<uint64_t>& hashes);

  // The pools of decoder layer `layer` (undefined for a layer without attention).
  const at::Tensor& k(int layer) const { return k_[layer]; }
  const at::Tensor& v(int layer) const { return v_[layer]; }

 private:
  KvCache() = default;
  int64_t block_size_ = 0, num_blocks_ = 0, bytes_per_block_ = 0;
  std::vector<at::Tensor> k_, v_;
  struct Meta {
    int32_t ref = 0;
    bool cached = false;
    uint64_t hash = 0;
    std::vector<int32_t> key;  // adapter, parent key and tokens: a hash match is checked
    std::list<int32_t>::iterator lru;
  };
  // One free block (evicting the least recently used cached one if need be), or -1.
  int32_t Take();
  int64_t Available() const;
  void Count();
  std::vector<int32_t> free_;  // freed blocks, a stack: the most recently freed reused first
  int64_t next_fresh_ = 0;     // blocks from here on have never been used
  std::vector<Meta> meta_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::list<int32_t> evictable_;  // cached blocks nobody holds, least recently used first
  std::atomic<int64_t> free_count_{0};
};

}  // namespace moelora

#endif  // MOELORA_WORKER_MODEL_KV_CACHE_H_
