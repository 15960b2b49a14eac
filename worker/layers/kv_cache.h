// The memory of the sequences on one worker (one tensor-parallel rank): the paged KV cache and
// the recurrent-state pool.
//
// KV cache: fixed-size blocks of `block_size` token positions. Every attention layer has its own
// K and V pool tensors ([blocks, block_size, kv_heads, head_dim] in the model's dtype, on the
// model's device). The full-attention layers share one block pool, sized by the memory budget,
// and a sequence holds one block table for all of them (block b of the table holds positions
// b · block_size .. (b + 1) · block_size - 1 in each layer's pool). Sliding-window layers share a
// second pool and table: a block whose positions every later query is past the window of is
// given back (its table entry becomes -1), so each sequence holds about window / block_size of
// them whatever its length, and that pool is sized once for --max-num-seqs sequences and one
// step's tokens, out of the same budget. Pages of the pools are touched only when written, and a
// block never used is taken only when no freed or cached block is left, so memory grows to the
// budget only as far as the sequences (and the prefix cache within what they touched) need it.
//
// Recurrent state (Gated DeltaNet): one entry per running sequence, from a pool of
// --max-num-seqs entries per layer (the conv window in the model's dtype, the SSM state in f32),
// taken by the first Reserve and zeroed then.
//
// Thread-safety: everything but the counts on the engine's compute thread only; the counts may
// be read from any thread.
#ifndef MOELORA_WORKER_LAYERS_KV_CACHE_H_
#define MOELORA_WORKER_LAYERS_KV_CACHE_H_

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
  int64_t window = 0;                  // sliding window (0: full attention)
};

// A recurrent layer's per-sequence state on this rank.
struct StateLayerShape {
  int layer = 0;
  std::vector<int64_t> conv;  // in the model's dtype
  std::vector<int64_t> ssm;   // f32
};

struct KvCacheOptions {
  int64_t block_size = 16;                  // --block-size
  int64_t memory_bytes = int64_t{4} << 30;  // --kv-cache-memory-bytes
  // At most this many full-attention blocks (0: no bound): no more than the sequences could
  // ever fill.
  int64_t max_blocks = 0;
  int64_t max_model_len = 0;  // a window this long or longer is full attention (0: unknown)
  // What sizes the sliding-window pool and the recurrent-state pool: the sequences that run at
  // once and the tokens of one step.
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 8192;
  // Positions behind a sequence's length its MTP heads' next queries may start (they keep that
  // many more positions of sliding-window blocks).
  int64_t head_lag = 0;
};

// What one sequence holds.
struct KvTable {
  std::vector<int32_t> blocks;         // full-attention layers: positions b · block_size .. in [b]
  std::vector<int32_t> window_blocks;  // sliding-window layers; -1: given back
  std::vector<uint64_t> hashes;        // prefix-cache keys of its leading full blocks
  int32_t state = -1;                  // recurrent-state entry, -1: none yet
  bool Holds() const { return !blocks.empty() || !window_blocks.empty() || state >= 0; }
};

// Blocks by number, with reference counts and a cache of full blocks by key. The KV cache has
// one for the full-attention layers and one for the sliding-window layers.
class BlockPool {
 public:
  // fresh_first: take a never-used block before evicting a cached one (a small pool, whose
  // every page is soon touched anyway, keeps its cache longer).
  explicit BlockPool(int64_t n = 0, bool fresh_first = false)
      : size_(n), fresh_first_(fresh_first) {}
  int64_t size() const { return size_; }
  // Free blocks, cached blocks nobody holds included.
  int64_t Available() const {
    return static_cast<int64_t>(free_.size() + evictable_.size()) + (size_ - next_fresh_);
  }
  // One free block (evicting the least recently used cached one if need be), or -1.
  int32_t Take();
  // One holder lets go of `b`: a cached block stays findable until evicted.
  void Drop(int32_t b);
  // The cached block with this key, or -1.
  int32_t Find(uint64_t hash, const std::vector<int32_t>& key) const;
  // One more holder of `b` (a cached block nobody held leaves the eviction order).
  void Hold(int32_t b);
  // Makes `b` findable by `hash` unless it is cached already or another block has the key.
  void Cache(int32_t b, uint64_t hash, std::vector<int32_t> key);

 private:
  struct Meta {
    int32_t ref = 0;
    bool cached = false;
    uint64_t hash = 0;
    std::vector<int32_t> key;  // adapter, parent key and tokens: a hash match is checked
    std::list<int32_t>::iterator lru;
  };
  int64_t size_ = 0;
  bool fresh_first_ = false;
  std::vector<int32_t> free_;  // freed blocks, a stack: the most recently freed reused first
  int64_t next_fresh_ = 0;     // blocks from here on have never been used
  std::vector<Meta> meta_;     // of the blocks used so far
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::list<int32_t> evictable_;  // cached blocks nobody holds, least recently used first
};

class KvCache {
 public:
  // num_layers: decoder layers in all. INVALID_ARGUMENT when the budget holds no full-attention
  // block, or not the sliding-window pool, naming the bytes each takes.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<KvCache>> Create(
      const std::vector<KvLayerShape>& layers, const std::vector<StateLayerShape>& states,
      int num_layers, const KvCacheOptions& o, at::ScalarType dtype, const at::Device& device);

  int64_t block_size() const { return block_size_; }
  // The full-attention pool: what admission counts.
  int64_t num_blocks() const { return full_.size(); }
  int64_t free_blocks() const { return free_count_.load(std::memory_order_relaxed); }
  // Bytes of one block over every full-attention layer (K and V).
  int64_t bytes_per_block() const { return bytes_per_block_; }
  // The sliding-window pool (0 blocks without such layers) and its free blocks.
  int64_t window_blocks() const { return window_pool_.size(); }
  int64_t window_free_blocks() const { return window_pool_.Available(); }
  int64_t window_bytes() const { return window_pool_.size() * window_bytes_per_block_; }
  // The recurrent-state pool: entries and the bytes of one over every layer.
  int64_t state_entries() const { return state_entries_; }
  int64_t state_bytes_per_entry() const { return state_bytes_; }
  // Blocks `tokens` positions take.
  int64_t BlocksFor(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // Grows `t` to cover positions 0 .. tokens - 1 in both tables, and gives it a recurrent-state
  // entry if it has none. False, with `t` unchanged, when either pool has too few free blocks or
  // no entry is free (cached blocks nobody holds count as free: the least recently used are
  // evicted).
  [[nodiscard]] bool Reserve(KvTable& t, int64_t tokens);
  // Gives back the sliding-window blocks no query at position `computed` or later can see.
  void Trim(KvTable& t, int64_t computed);
  // Gives back everything `t` holds (a cached block stays cached until evicted) and clears it.
  void Release(KvTable& t);
  // Gives back the blocks past position tokens - 1 in both tables (speculative tokens a verify
  // rejected); prefix-cache keys of blocks no longer full are dropped.
  void Shrink(KvTable& t, int64_t tokens);

  // Prefix caching. A full block is keyed by (the adapter, the key of the block before it, its
  // tokens), so a prefix is shared only under the same adapter (0: the base model).
  // Match fills the empty `t` with the cached blocks that hold the longest prefix of `tokens` in
  // whole blocks, leaving at least one token to compute (with sliding-window layers, only as far
  // as their blocks within the window before it are cached too), and returns how many tokens
  // they hold.
  int64_t Match(int64_t adapter, const std::vector<int32_t>& tokens, KvTable& t);
  // Makes the full blocks of `t` among positions 0 .. len - 1 (tokens[p] at position p) that
  // its hashes do not cover yet findable by Match, in both pools. A block whose key is cached
  // already (another copy) stays private.
  void Publish(int64_t adapter, const std::vector<int32_t>& tokens, int64_t len, KvTable& t);

  // The pools of decoder layer `layer` (undefined for a layer without attention), and whether
  // it reads the sliding-window table.
  const at::Tensor& k(int layer) const { return k_[layer]; }
  const at::Tensor& v(int layer) const { return v_[layer]; }
  bool windowed(int layer) const { return windowed_[layer]; }
  const std::vector<int32_t>& table(int layer, const KvTable& t) const {
    return windowed_[layer] ? t.window_blocks : t.blocks;
  }
  // A recurrent layer's state for entry `e` (views into the pool).
  at::Tensor conv(int layer, int32_t e) const { return conv_[layer].select(0, e); }
  at::Tensor ssm(int layer, int32_t e) const { return ssm_[layer].select(0, e); }

 private:
  KvCache() = default;
  void Count() { free_count_.store(full_.Available(), std::memory_order_relaxed); }
  int64_t block_size_ = 0, bytes_per_block_ = 0, window_bytes_per_block_ = 0;
  int64_t window_ = 0;  // the widest sliding window of the windowed layers
  BlockPool full_, window_pool_;
  std::vector<at::Tensor> k_, v_;
  std::vector<bool> windowed_;
  int64_t state_entries_ = 0, state_bytes_ = 0;
  std::vector<at::Tensor> conv_, ssm_;
  std::vector<int32_t> free_states_;
  std::atomic<int64_t> free_count_{0};
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_KV_CACHE_H_
