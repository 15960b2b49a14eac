#include "worker/layers/lora_ops.h"

#include <ATen/Parallel.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace moelora {

at::Tensor ToFloat(const HostTensor& h) {
  std::vector<int64_t> shape(h.shape.begin(), h.shape.end());
  at::ScalarType st = h.dtype == DType::kBF16  ? at::kBFloat16
                      : h.dtype == DType::kF16 ? at::kHalf
                                               : at::kFloat;
  // Aligned f32 is read where it lies (a view for the caller's copies: adapter staging spent
  // about a third of its slot writes on these copies).
  if (st == at::kFloat && reinterpret_cast<uintptr_t>(h.data()) % alignof(float) == 0) {
    return at::from_blob(h.data(), shape, at::TensorOptions().dtype(at::kFloat));
  }
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(st));
  std::memcpy(t.data_ptr(), h.data(), h.nbytes());
  return t.to(at::kFloat);
}

at::Tensor ToFloatScaled(const HostTensor& h, double scaling) {
  at::Tensor t = ToFloat(h);
  return scaling == 1.0 ? t : t * scaling;  // x * 1 is x: no pass for the common alpha == r
}

DType KernelDType(at::ScalarType t) {
  return t == at::kBFloat16 ? DType::kBF16 : t == at::kHalf ? DType::kF16 : DType::kF32;
}

at::Tensor EmptyWeight(at::IntArrayRef shape, at::ScalarType dtype) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(shape)) * c10::elementSize(dtype);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHuge) {
    const size_t cap = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = nullptr;
    if (posix_memalign(&p, kHuge, cap) == 0) {
      ::madvise(p, cap, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KB
      return at::from_blob(
          p, shape, [](void* q) { std::free(q); }, at::TensorOptions().dtype(dtype));
    }
  }
#endif
  return at::empty(shape, at::TensorOptions().dtype(dtype));
}

at::Tensor SlotZeros(at::IntArrayRef shape, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) return at::zeros(shape, options);
  const size_t bytes =
      static_cast<size_t>(c10::multiply_integers(shape)) * options.dtype().itemsize();
  void* p = bytes > 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                      : MAP_FAILED;
  if (p == MAP_FAILED) return EmptyWeight(shape, options.dtype().toScalarType()).zero_();
#ifdef MADV_HUGEPAGE
  ::madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KB
#endif
  return at::from_blob(
      p, shape, [bytes](void* q) { ::munmap(q, bytes); }, options);
}

void ZeroSlot(at::Tensor slot) {
  if (!slot.device().is_cpu() || !slot.is_contiguous()) {
    slot.zero_();
    return;
  }
  // Private anonymous memory reads as zero once its pages are given back (MADV_DONTNEED); the
  // partial pages at either end are cleared by hand.
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  char* b = static_cast<char*>(slot.data_ptr());
  char* e = b + slot.nbytes();
  char* lo = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(b) + page - 1) / page * page);
  char* hi = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(e) / page * page);
  if (hi <= lo || ::madvise(lo, static_cast<size_t>(hi - lo), MADV_DONTNEED) != 0) {
    std::memset(b, 0, slot.nbytes());
    return;
  }
  std::memset(b, 0, static_cast<size_t>(lo - b));
  std::memset(hi, 0, static_cast<size_t>(e - hi));
}

int64_t ResidentBytes(const at::Tensor& t) {
  if (!t.defined() || t.nbytes() == 0) return 0;
  if (!t.device().is_cpu()) return static_cast<int64_t>(t.nbytes());
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t b = reinterpret_cast<uintptr_t>(t.data_ptr()) / page * page;
  const uintptr_t e = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes();
  std::vector<unsigned char> in((e - b + page - 1) / page);
  if (::mincore(reinterpret_cast<void*>(b), e - b, in.data()) != 0) {
    return static_cast<int64_t>(t.nbytes());
  }
  int64_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return std::min<int64_t>(n * static_cast<int64_t>(page), static_cast<int64_t>(t.nbytes()));
}

at::Tensor Scratch(size_t bytes, const at::Device& dev) {
  return at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))},
                   at::TensorOptions().dtype(at::kByte).device(dev));
}

at::Tensor GatherRanges(const at::Tensor& t, int64_t dim, const std::vector<IndexRange>& ranges) {
  if (ranges.size() == 1) return t.narrow(dim, ranges[0].begin, ranges[0].size);
  std::vector<at::Tensor> parts;
  for (const IndexRange& r : ranges) parts.push_back(t.narrow(dim, r.begin, r.size));
  return at::cat(parts, dim);
}

at::ScalarType CpuSlotDType(at::ScalarType model_dtype) {
  return model_dtype == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

SgmvWeight SgmvWeightOf(const at::Tensor& slots) {
  return slots.scalar_type() == at::kBFloat16 ? SgmvWeight::kBF16 : SgmvWeight::kF32;
}

const void* SlotElement(const at::Tensor& slots, int64_t offset) {
  return static_cast<const char*>(slots.data_ptr()) + offset * slots.element_size();
}

namespace {
// Runs SGMV segments in parallel (segments write disjoint rows). A long segment (a dense layer's
// rows of one adapter, or prefill) goes in pieces of kPiece rows, so every thread has a share
// when the batch has one or two adapters; each piece still reads A and B once per four rows.
void RunSgmv(const SgmvParams& p, const std::vector<SgmvSegment>& segs) {
  if (segs.empty()) return;
  constexpr int64_t kPiece = 8;
  const std::vector<SgmvSegment>* run = &segs;
  std::vector<SgmvSegment> pieces;
  if (std::any_of(segs.begin(), segs.end(),
                  [](const SgmvSegment& s) { return s.end - s.begin > kPiece; })) {
    for (const SgmvSegment& s : segs) {
      for (int64_t b = s.begin; b < s.end; b += kPiece) {
        SgmvSegment piece = s;
        piece.begin = b;
        piece.end = std::min(s.end, b + kPiece);
        pieces.push_back(piece);
      }
    }
    run = &pieces;
  }
  at::parallel_for(0, static_cast<int64_t>(run->size()), 1,
                   [&](int64_t b, int64_t e) { SgmvCpu(p, run->data(), b, e); });
}
}  // namespace

void AddLora(const at::Tensor& x, at::Tensor& out, int64_t out_col, int64_t out_dim,
             const int64_t* rows, int64_t r_stride, SgmvWeight w,
             const std::vector<SgmvSegment>& segs) {
  if (segs.empty()) return;
  if (x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && x.is_contiguous() &&
      out.is_contiguous()) {
    SgmvParams p{x.data_ptr<float>(),
                 x.size(1),
                 out.data_ptr<float>() + out_col,
                 out.size(1),
                 rows,
                 x.size(1),
                 out_dim,
                 r_stride,
                 w};
    RunSgmv(p, segs);
    return;
  }
  if (x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
      out.stride(1) == 1) {
    // bf16 rows read and accumulated in place (one rounding per element).
    SgmvParams p;
    p.x_bf16 = static_cast<const uint16_t*>(x.data_ptr());
    p.x_stride = x.stride(0);
    p.out_bf16 = static_cast<uint16_t*>(out.data_ptr()) + out_col;
    p.out_stride = out.stride(0);
    p.rows = rows;
    p.in_dim = x.size(1);
    p.out_dim = out_dim;
    p.r_stride = r_stride;
    p.w_type = w;
    RunSgmv(p, segs);
    return;
  }
  // The columns the segments write, past out_col (a segment's own offset, a second B).
  int64_t span = 0;
  for (const SgmvSegment& s : segs) {
    span = std::max(span, s.out_col + (s.b2_t != nullptr ? 2 : 1) * out_dim);
  }
  at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor d32 = at::zeros({out.size(0), span}, x32.options());
  SgmvParams p{x32.data_ptr<float>(),
               x32.size(1),
               d32.data_ptr<float>(),
               span,
               rows,
               x32.size(1),
               out_dim,
               r_stride,
               w};
  RunSgmv(p, segs);
  out.narrow(1, out_col, span).add_(d32.to(out.scalar_type()));
}

}  // namespace moelora
