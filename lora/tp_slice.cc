#include "lora/tp_slice.h"

#include "absl/strings/str_cat.h"

namespace moelora {

const char* TpModeName(TpMode m) {
  switch (m) {
    case TpMode::kReplicated:
      return "replicated";
    case TpMode::kColumn:
      return "column-parallel";
    case TpMode::kRow:
      return "row-parallel";
  }
  return "?";
}

[[nodiscard]] absl::StatusOr<std::vector<IndexRange>> ShardSections(
    const std::vector<int64_t>& sections, int tp_rank, int tp_size) {
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel rank ", tp_rank, " outside [0, ", tp_size, ")"));
  }
  std::vector<IndexRange> out;
  int64_t offset = 0;
  for (size_t i = 0; i < sections.size(); ++i) {
    const int64_t n = sections[i];
    if (n < 0 || n % tp_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat("section ", i, " of size ", n,
                                                     " does not divide by the tensor-parallel "
                                                     "size ",
                                                     tp_size));
    }
    const int64_t part = n / tp_size;
    out.push_back({offset + tp_rank * part, part});
    offset += n;
  }
  return out;
}

int64_t TotalSize(const std::vector<IndexRange>& ranges) {
  int64_t n = 0;
  for (const IndexRange& r : ranges) n += r.size;
  return n;
}

[[nodiscard]] absl::StatusOr<LoraShard> PlanLoraShard(TpMode mode, int64_t in_full,
                                                      const std::vector<int64_t>& out_sections,
                                                      int tp_rank, int tp_size) {
  int64_t out_full = 0;
  for (int64_t n : out_sections) out_full += n;
  LoraShard s;
  switch (mode) {
    case TpMode::kReplicated:
      s.a_cols = {{0, in_full}};
      s.b_rows = {{0, out_full}};
      break;
    case TpMode::kColumn: {
      s.a_cols = {{0, in_full}};
      auto rows = ShardSections(out_sections, tp_rank, tp_size);
      if (!rows.ok()) return rows.status();
      s.b_rows = *std::move(rows);
      break;
    }
    case TpMode::kRow: {
      auto cols = ShardSections({in_full}, tp_rank, tp_size);
      if (!cols.ok()) return cols.status();
      s.a_cols = *std::move(cols);
      s.b_rows = {{0, out_full}};
      break;
    }
  }
  s.in_local = TotalSize(s.a_cols);
  s.out_local = TotalSize(s.b_rows);
  return s;
}

}  // namespace moelora
