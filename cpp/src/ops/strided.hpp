// Internal: iteration over broadcast, strided operands in result-ordinal order.
//
// A plan holds the result's flat leaf extents and, per operand, the flat
// strides of its layout broadcast to the result shape (0 along broadcast
// leaves). `for_each_run` calls f(ordinal, offsets[], count, inner_strides[])
// for each run of the first non-trivial leaf: kernels loop over the run with
// the given strides, so there is no per-element dispatch.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "compute_pool.hpp"
#include "strideweave/layout.hpp"

namespace sw::detail {

template <size_t K>
struct StridedPlan {
  std::vector<int64_t> extents;                 // result leaves (extent-1 leaves dropped)
  std::vector<std::array<int64_t, K>> strides;  // per leaf, per operand
  std::array<int64_t, K> base{};                // starting offset per operand
  int64_t size = 1;

  // Adds leaves; operand strides must align with `result_extents` leaf by leaf.
  static StridedPlan make(const std::vector<int64_t>& result_extents,
                          const std::array<const std::vector<int64_t>*, K>& operand_strides,
                          const std::array<int64_t, K>& offsets) {
    StridedPlan p;
    p.base = offsets;
    for (size_t j = 0; j < result_extents.size(); ++j) {
      if (result_extents[j] == 1) continue;
      std::array<int64_t, K> s{};
      for (size_t k = 0; k < K; ++k) s[k] = (*operand_strides[k])[j];
      // Merge with the previous leaf when every operand continues it.
      if (!p.extents.empty()) {
        bool merge = true;
        for (size_t k = 0; k < K; ++k)
          if (s[k] != p.strides.back()[k] * p.extents.back()) merge = false;
        if (merge) {
          p.extents.back() *= result_extents[j];
          p.size *= result_extents[j];
          continue;
        }
      }
      p.extents.push_back(result_extents[j]);
      p.strides.push_back(s);
      p.size *= result_extents[j];
    }
    return p;
  }

  // Runs f(ordinal, offsets, count, inner) over ordinals [begin, end).
  template <class F>
  void for_each_run(int64_t begin, int64_t end, F&& f) const {
    if (begin >= end) return;
    if (extents.empty()) {
      f(begin, base, end - begin, std::array<int64_t, K>{});
      return;
    }
    const size_t L = extents.size();
    const int64_t inner = extents[0];
    std::array<int64_t, K> in_stride = strides[0];
    // Decode `begin` into the odometer.
    int64_t c_small[8];
    std::vector<int64_t> c_big(L > 8 ? L : 0);
    int64_t* c = L > 8 ? c_big.data() : c_small;
    int64_t rest = begin;
    std::array<int64_t, K> off = base;
    for (size_t j = 0; j < L; ++j) {
      c[j] = rest % extents[j];
      rest /= extents[j];
      for (size_t k = 0; k < K; ++k) off[k] += c[j] * strides[j][k];
    }
    int64_t ord = begin;
    while (ord < end) {
      int64_t count = std::min(inner - c[0], end - ord);
      f(ord, off, count, in_stride);
      ord += count;
      for (size_t k = 0; k < K; ++k) off[k] += count * in_stride[k];
      c[0] += count;
      if (c[0] < inner) continue;
      for (size_t k = 0; k < K; ++k) off[k] -= inner * in_stride[k];
      c[0] = 0;
      for (size_t j = 1; j < L; ++j) {
        for (size_t k = 0; k < K; ++k) off[k] += strides[j][k];
        if (++c[j] < extents[j]) break;
        for (size_t k = 0; k < K; ++k) off[k] -= strides[j][k] * extents[j];
        c[j] = 0;
      }
    }
  }
};

// Splits [0, n) over the compute threads when the work is large (see Note
// [Compute pool]); f(begin, end) is called once per part. With
// parts_per_thread > 1 the parts are smaller than a thread's share and the
// threads claim them as they go: a long kernel then finishes on time even when
// one of its threads loses its core for a while (another library's spinning
// threads, an I/O thread), since the others take the parts it has not begun.
template <class F>
void parallel_for(int64_t n, int64_t grain, F&& f, int64_t parts_per_thread = 1) {
  if (n < 2 * grain) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t parts =
      std::min<int64_t>(compute_threads() * std::max<int64_t>(parts_per_thread, 1), n / std::max<int64_t>(grain, 1));
  if (parts <= 1) {
    f(int64_t{0}, n);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  struct Ctx {
    Fn* f;
    int64_t n, chunk;
  } ctx{&f, n, (n + parts - 1) / parts};
  run_parts(parts, [](void* c, int64_t i) {
    auto* x = static_cast<Ctx*>(c);
    const int64_t b = i * x->chunk, e = std::min(x->n, b + x->chunk);
    if (b < e) (*x->f)(b, e);
  }, &ctx);
}

}  // namespace sw::detail
