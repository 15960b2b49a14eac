#include "worker/layers/kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moelora {

// Memory already touched first: a freed block, then the least recently used cached block (its
// prefix is forgotten), and only then a block never used. Taking never-used blocks first kept
// the cached ones longer, but every step then faulted in fresh pages (with transparent huge
// pages 2 MB zeroed at a time): bench/decode_step's 32 x 16-token prefill 62 -> 73-76 ms.
int32_t BlockPool::Take() {
  int32_t b = -1;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (fresh_first_ && next_fresh_ < size_) {
    b = static_cast<int32_t>(next_fresh_++);
    meta_.emplace_back();
  } else if (!evictable_.empty()) {
    b = evictable_.front();
    evictable_.pop_front();
    Meta& m = meta_[b];
    by_hash_.erase(m.hash);
    m.cached = false;
    m.key.clear();
  } else if (next_fresh_ < size_) {
    b = static_cast<int32_t>(next_fresh_++);
    meta_.emplace_back();  // metadata only for blocks in use: a pool may be large and idle
  }
  if (b >= 0) meta_[b].ref = 1;
  return b;
}

void BlockPool::Drop(int32_t b) {
  Meta& m = meta_[b];
  if (--m.ref > 0) return;
  if (m.cached) {
    m.lru = evictable_.insert(evictable_.end(), b);
  } else {
    free_.push_back(b);
  }
}

int32_t BlockPool::Find(uint64_t hash, const std::vector<int32_t>& key) const {
  auto it = by_hash_.find(hash);
  return it == by_hash_.end() || meta_[it->second].key != key ? -1 : it->second;
}

void BlockPool::Hold(int32_t b) {
  Meta& m = meta_[b];
  if (m.ref++ == 0 && m.cached) evictable_.erase(m.lru);
}

void BlockPool::Cache(int32_t b, uint64_t hash, std::vector<int32_t> key) {
  Meta& m = meta_[b];
  if (m.cached || by_hash_.count(hash)) return;
  m.cached = true;
  m.hash = hash;
  m.key = std::move(key);
  by_hash_[hash] = b;
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const std::vector<KvLayerShape>& layers,
                                                         const std::vector<StateLayerShape>& states,
                                                         int num_layers, const KvCacheOptions& o,
                                                         at::ScalarType dtype,
                                                         const at::Device& device) {
  const int64_t bs = o.block_size;
  if (bs < 1) return absl::InvalidArgumentError("--block-size must be >= 1");
  if (o.max_num_seqs < 1 || o.max_num_batched_tokens < 1) {
    return absl::InvalidArgumentError("--max-num-seqs and --max-num-batched-tokens must be >= 1");
  }
  std::unique_ptr<KvCache> c(new KvCache());
  c->block_size_ = bs;
  c->windowed_.assign(num_layers, false);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  bool any_full = false;
  for (const KvLayerShape& l : layers) {
    const int64_t bytes = 2 * bs * l.kv_heads * l.head_dim * elem;
    if (l.window > 0 && (o.max_model_len <= 0 || l.window < o.max_model_len)) {
      c->windowed_[l.layer] = true;
      c->window_bytes_per_block_ += bytes;
      c->window_ = std::max(c->window_, l.window);
    } else {
      c->bytes_per_block_ += bytes;
      any_full = true;
    }
  }
  // The sliding-window pool never runs short: between steps a sequence holds at most
  // (window + head_lag - 2) / bs + 2 blocks (Trim), and a step adds its tokens' blocks, at most
  // one more per sequence than they fill.
  int64_t wblocks = 0;
  if (c->window_ > 0) {
    wblocks = o.max_num_seqs * ((c->window_ + o.head_lag + bs - 1) / bs + 3) +
              (o.max_num_batched_tokens + bs - 1) / bs;
    if (o.max_blocks > 0) wblocks = std::min(wblocks, o.max_blocks);
  }
  const int64_t wbytes = wblocks * c->window_bytes_per_block_;
  const int64_t left = o.memory_bytes - wbytes;
  int64_t blocks = any_full && left > 0 ? left / c->bytes_per_block_ : 0;
  if (o.max_blocks > 0) blocks = std::min(blocks, o.max_blocks);
  if ((any_full && blocks < 1) || left < 0) {
    std::string why = absl::StrCat("--kv-cache-memory-bytes ", o.memory_bytes,
                                   " holds no KV cache block: one block of ", bs, " tokens takes ",
                                   c->bytes_per_block_, " bytes on this rank");
    if (wblocks > 0) {
      absl::StrAppend(&why, " beside the sliding-window layers' ", wblocks, " blocks (", wbytes,
                      " bytes for --max-num-seqs ", o.max_num_seqs,
                      " and --max-num-batched-tokens ", o.max_num_batched_tokens, ")");
    }
    return absl::InvalidArgumentError(why);
  }
  // No full-attention layer: the table still counts positions, and takes no memory.
  if (!any_full) blocks = o.max_blocks > 0 ? o.max_blocks : 1 << 20;
  blocks = std::min<int64_t>(blocks, INT32_MAX);
  c->full_ = BlockPool(blocks);
  c->window_pool_ = BlockPool(wblocks, /*fresh_first=*/true);
  c->k_.resize(num_layers);
  c->v_.resize(num_layers);
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  for (const KvLayerShape& l : layers) {
    const int64_t n = c->windowed_[l.layer] ? wblocks : blocks;
    // at::empty: the pages are touched when a block is first written, not here.
    c->k_[l.layer] = at::empty({n, bs, l.kv_heads, l.head_dim}, opts);
    c->v_[l.layer] = at::empty({n, bs, l.kv_heads, l.head_dim}, opts);
  }
  if (!states.empty()) {
    c->state_entries_ = o.max_num_seqs;
    c->conv_.resize(num_layers);
    c->ssm_.resize(num_layers);
    const auto f32 = opts.dtype(at::kFloat);
    for (const StateLayerShape& s : states) {
      std::vector<int64_t> conv = {o.max_num_seqs}, ssm = {o.max_num_seqs};
      conv.insert(conv.end(), s.conv.begin(), s.conv.end());
      ssm.insert(ssm.end(), s.ssm.begin(), s.ssm.end());
      c->conv_[s.layer] = at::empty(conv, opts);  // zeroed entry by entry when taken
      c->ssm_[s.layer] = at::empty(ssm, f32);
      c->state_bytes_ +=
          c->conv_[s.layer].nbytes() / o.max_num_seqs + c->ssm_[s.layer].nbytes() / o.max_num_seqs;
    }
    for (int64_t e = o.max_num_seqs; e-- > 0;) c->free_states_.push_back(static_cast<int32_t>(e));
  }
  c->Count();
  return c;
}

bool KvCache::Reserve(KvTable& t, int64_t tokens) {
  const int64_t need = BlocksFor(tokens);
  const int64_t nf = std::max<int64_t>(0, need - static_cast<int64_t>(t.blocks.size()));
  const int64_t nw =
      window_ > 0 ? std::max<int64_t>(0, need - static_cast<int64_t>(t.window_blocks.size())) : 0;
  const bool ns = state_entries_ > 0 && t.state < 0;
  if (nf > full_.Available() || nw > window_pool_.Available() || (ns && free_states_.empty())) {
    return false;
  }
  for (int64_t i = 0; i < nf; ++i) t.blocks.push_back(full_.Take());
  for (int64_t i = 0; i < nw; ++i) t.window_blocks.push_back(window_pool_.Take());
  if (ns) {
    t.state = free_states_.back();
    free_states_.pop_back();
    for (size_t l = 0; l < conv_.size(); ++l) {
      if (!conv_[l].defined()) continue;
      conv(static_cast<int>(l), t.state).zero_();
      ssm(static_cast<int>(l), t.state).zero_();
    }
  }
  Count();
  return true;
}

void KvCache::Trim(KvTable& t, int64_t computed) {
  if (window_ == 0) return;
  // Block b's last position, (b + 1) · bs - 1, is out of every later query's window when it is
  // <= computed - window.
  const int64_t gone = std::min<int64_t>((computed - window_ + 1) / block_size_,
                                         static_cast<int64_t>(t.window_blocks.size()));
  // Given-back blocks are a prefix of the table: walk back to it, then give back in position
  // order, so the cache evicts the earliest first (a match needs the blocks just before it).
  int64_t b = gone;
  while (b > 0 && t.window_blocks[b - 1] >= 0) --b;
  for (; b < gone; ++b) {
    window_pool_.Drop(t.window_blocks[b]);
    t.window_blocks[b] = -1;
  }
}

void KvCache::Shrink(KvTable& t, int64_t tokens) {
  const auto keep = static_cast<size_t>(BlocksFor(std::max<int64_t>(tokens, 0)));
  while (t.blocks.size() > keep) {
    full_.Drop(t.blocks.back());
    t.blocks.pop_back();
  }
  while (t.window_blocks.size() > keep) {
    if (t.window_blocks.back() >= 0) window_pool_.Drop(t.window_blocks.back());
    t.window_blocks.pop_back();
  }
  const auto full = static_cast<size_t>(std::max<int64_t>(tokens, 0) / block_size_);
  if (t.hashes.size() > full) t.hashes.resize(full);
  Count();
}

void KvCache::Release(KvTable& t) {
  // Full attention in reverse: block 0 is freed last, so the stack hands it out first, and a
  // prefix's last blocks are evicted before its first. Sliding windows in position order, as
  // Trim gives them back.
  for (auto it = t.blocks.rbegin(); it != t.blocks.rend(); ++it) full_.Drop(*it);
  for (int32_t w : t.window_blocks) {
    if (w >= 0) window_pool_.Drop(w);
  }
  if (t.state >= 0) free_states_.push_back(t.state);
  t = KvTable();
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

int64_t KvCache::Match(int64_t adapter, const std::vector<int32_t>& tokens, KvTable& t) {
  if (t.Holds()) return 0;
  const int64_t most = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
  std::vector<uint64_t> hashes;
  std::vector<std::vector<int32_t>> keys;
  std::vector<int32_t> found;
  for (int64_t b = 0; b < most; ++b) {
    keys.push_back(
        BlockKey(adapter, b > 0 ? hashes.back() : 0, tokens.data() + b * block_size_, block_size_));
    hashes.push_back(KeyHash(keys.back()));
    const int32_t f = full_.Find(hashes.back(), keys.back());
    if (f < 0) break;
    found.push_back(f);
  }
  int64_t m = static_cast<int64_t>(found.size());
  // The sliding-window layers need the blocks within the window before the first token left
  // to compute, cached under the same keys; a shorter prefix may have them.
  std::vector<int32_t> wfound;
  int64_t lo = 0;
  for (; window_ > 0 && m > 0; --m) {
    lo = std::max<int64_t>(0, m * block_size_ - window_ + 1) / block_size_;
    wfound.clear();
    for (int64_t b = lo; b < m; ++b) {
      const int32_t w = window_pool_.Find(hashes[b], keys[b]);
      if (w < 0) break;
      wfound.push_back(w);
    }
    if (static_cast<int64_t>(wfound.size()) == m - lo) break;
  }
  for (int64_t b = 0; b < m; ++b) {
    full_.Hold(found[b]);
    t.blocks.push_back(found[b]);
    t.hashes.push_back(hashes[b]);
  }
  if (window_ > 0 && m > 0) {
    t.window_blocks.assign(lo, -1);
    for (int32_t w : wfound) {
      window_pool_.Hold(w);
      t.window_blocks.push_back(w);
    }
  }
  Count();
  return m * block_size_;
}

void KvCache::Publish(int64_t adapter, const std::vector<int32_t>& tokens, int64_t len,
                      KvTable& t) {
  const int64_t full = std::min<int64_t>(len / block_size_, static_cast<int64_t>(t.blocks.size()));
  for (int64_t b = static_cast<int64_t>(t.hashes.size()); b < full; ++b) {
    std::vector<int32_t> key = BlockKey(adapter, b > 0 ? t.hashes[b - 1] : 0,
                                        tokens.data() + b * block_size_, block_size_);
    const uint64_t h = KeyHash(key);
    t.hashes.push_back(h);
    if (b < static_cast<int64_t>(t.window_blocks.size()) && t.window_blocks[b] >= 0) {
      window_pool_.Cache(t.window_blocks[b], h, key);
    }
    full_.Cache(t.blocks[b], h, std::move(key));
  }
}

}  // namespace moelora
