#include "worker/layers/forward_batch.h"

namespace moelora {

SeqState& SeqState::operator=(SeqState&& o) noexcept {
  if (this == &o) return *this;
  if (kv != nullptr) kv->Release(table);
  len = o.len;
  mtp_len = o.mtp_len;
  steps = std::move(o.steps);
  table = std::move(o.table);
  kv = o.kv;
  o.table = KvTable();
  o.kv = nullptr;
  o.len = 0;
  o.mtp_len = {};
  return *this;
}

SeqState::~SeqState() {
  if (kv != nullptr) kv->Release(table);
}

}  // namespace moelora
