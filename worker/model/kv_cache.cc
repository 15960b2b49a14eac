#include "worker/model/kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moelora {

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const std::vector<KvLayerShape>& layers,
                                                         int num_layers, const KvCacheOptions& o,
                                                         at::ScalarType dtype,
                                                         const at::Device& device) {
  if (o.block_size < 1) return absl::InvalidArgumentError("--block-size must be >= 1");
  std::unique_ptr<KvCache> c(new KvCache());
  c->block_size_ = o.block_size;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  for (const KvLayerShape& l : layers) {
    c->bytes_per_block_ += 2 * o.block_size * l.kv_heads * l.head_dim * elem;
  }
  int64_t blocks = c->bytes_per_block_ > 0 ? o.memory_bytes / c->bytes_per_block_ : 0;
  if (o.max_blocks > 0) blocks = std::min(blocks, o.max_blocks);
  if (!layers.empty() && blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-cache-memory-bytes ", o.memory_bytes, " holds no KV cache block: one block of ",
        o.block_size, " tokens takes ", c->bytes_per_block_, " bytes on this rank"));
  }
  if (layers.empty()) blocks = o.max_blocks > 0 ? o.max_blocks : 1 << 20;  // no attention: free
  if (blocks > INT32_MAX) blocks = INT32_MAX;
  c->num_blocks_ = blocks;
  c->k_.resize(num_layers);
  c->v_.resize(num_layers);
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  for (const KvLayerShape& l : layers) {
    // at::empty: the pages are touched when a block is first written, not here.
    c->k_[l.layer] = at::empty({blocks, o.block_size, l.kv_heads, l.head_dim}, opts);
    c->v_[l.layer] = at::empty({blocks, o.block_size, l.kv_heads, l.head_dim}, opts);
  }
  c->meta_.resize(blocks);
  c->Count();
  return c;
}

int64_t KvCache::Available() const {
  return static_cast<int64_t>(free_.size() + evictable_.size()) + (num_blocks_ - next_fresh_);
}

void KvCache::Count() { free_count_.store(Available(), std::memory_order_relaxed); }

// Memory already touched first: a freed block, then the least recently used cached block (its
// prefix is forgotten), and only then a block never used. Taking never-used blocks first kept
// the cached ones longer, but every step then faulted in fresh pages (with transparent huge
// pages 2 MB zeroed at a time): bench/decode_step's 32 x 16-token prefill 62 -> 73-76 ms.
int32_t KvCache::Take() {
  int32_t b = -1;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!evictable_.empty()) {
    b = evictable_.front();
    evictable_.pop_front();
    Meta& m = meta_[b];
    by_hash_.erase(m.hash);
    m.cached = false;
    m.key.clear();
  } else if (next_fresh_ < num_blocks_) {
    b = static_cast<int32_t>(next_fresh_++);
  }
  if (b >= 0) meta_[b].ref = 1;
  return b;
}

bool KvCache::Reserve(std::vector<int32_t>& table, int64_t tokens) {
  const int64_t need = BlocksFor(tokens) - static_cast<int64_t>(table.size());
  if (need <= 0) return true;
  if (need > Available()) return false;
  for (int64_t i = 0; i < need; ++i) table.push_back(Take());
  Count();
  return true;
}

void KvCache::Release(std::vector<int32_t>& table) {
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    Meta& m = meta_[*it];
    if (--m.ref > 0) continue;
    if (m.cached) {
      m.lru = evictable_.insert(evictable_.end(), *it);
    } else {
      free_.push_back(*it);
    }
  }
  table.clear();
  Count();
}

namespace {

// The key of a full block: the same on every rank (absl::Hash is seeded per process, and the
// ranks must make the same choices), a splitmix64 chain over the adapter, the parent key and the
// tokens.
uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 27;
  h *= 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

std::vector<int32_t> BlockKey(int64_t adapter, uint64_t parent, const int32_t* tokens, int64_t n) {
  std::vector<int32_t> k = {static_cast<int32_t>(adapter), static_cast<int32_t>(adapter >> 32),
                            static_cast<int32_t>(parent), static_cast<int32_t>(parent >> 32)};
  k.insert(k.end(), tokens, tokens + n);
  return k;
}

uint64_t KeyHash(const std::vector<int32_t>& key) {
  uint64_t h = 0;
  for (int32_t v : key) h = Mix(h, static_cast<uint32_t>(v));
  return h;
}

}  // namespace

int64_t KvCache::Match(int64_t adapter, const std::vector<int32_t>& tokens,
                       std::vector<int32_t>& table, std::vector<uint64_t>& hashes) {
  if (!table.empty()) return 0;
  const int64_t most = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
  uint64_t parent = 0;
  for (int64_t b = 0; b < most; ++b) {
    std::vector<int32_t> key =
        BlockKey(adapter, parent, tokens.data() + b * block_size_, block_size_);
    const uint64_t h = KeyHash(key);
    auto it = by_hash_.find(h);
    if (it == by_hash_.end() || meta_[it->second].key != key) break;
    Meta& m = meta_[it->second];
    if (m.ref++ == 0) evictable_.erase(m.lru);
    table.push_back(it->second);
    hashes.push_back(h);
    parent = h;
  }
  Count();
  return static_cast<int64_t>(table.size()) * block_size_;
}

void KvCache::Publish(int64_t adapter, const std::vector<int32_t>& tokens, int64_t len,
                      const std::vector<int32_t>& table, std::vector<uint64_t>& hashes) {
  const int64_t full = std::min<int64_t>(len / block_size_, static_cast<int64_t>(table.size()));
  for (int64_t b = static_cast<int64_t>(hashes.size()); b < full; ++b) {
    const uint64_t parent = b > 0 ? hashes[b - 1] : 0;
    std::vector<int32_t> key =
        BlockKey(adapter, parent, tokens.data() + b * block_size_, block_size_);
    const uint64_t h = KeyHash(key);
    hashes.push_back(h);
    Meta& m = meta_[table[b]];
    if (m.cached || by_hash_.count(h)) continue;
    m.cached = true;
    m.hash = h;
    m.key = std::move(key);
    by_hash_[h] = table[b];
  }
}

}  // namespace moelora
