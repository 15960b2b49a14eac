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
  c->free_.resize(blocks);
  // Block 0 on top of the stack: a fresh cache hands out blocks in ascending order.
  for (int64_t i = 0; i < blocks; ++i) c->free_[i] = static_cast<int32_t>(blocks - 1 - i);
  c->free_count_ = blocks;
  return c;
}

bool KvCache::Reserve(std::vector<int32_t>& table, int64_t tokens) {
  const int64_t need = BlocksFor(tokens) - static_cast<int64_t>(table.size());
  if (need <= 0) return true;
  if (need > static_cast<int64_t>(free_.size())) return false;
  for (int64_t i = 0; i < need; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  free_count_.store(static_cast<int64_t>(free_.size()), std::memory_order_relaxed);
  return true;
}

void KvCache::Release(std::vector<int32_t>& table) {
  for (auto it = table.rbegin(); it != table.rend(); ++it) free_.push_back(*it);
  table.clear();
  free_count_.store(static_cast<int64_t>(free_.size()), std::memory_order_relaxed);
}

}  // namespace moelora
