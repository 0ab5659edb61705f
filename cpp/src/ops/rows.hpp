// Internal: the row operations (softmax, topk, index_select, index_add): their geometry, kernel entries and VJPs.
// See Note [Row operations] in rows.cpp.
#pragma once

#include <span>
#include <vector>

#include "strideweave/ops.hpp"
#include "vjps.hpp"

namespace sw::detail {

// A tensor seen along one of its modes: `extent` elements `stride` slots apart per row, one row per ordinal of
// the other modes' leaves (`outer_extents`, first fastest, with `outer_strides`).
struct RowGeometry {
  int64_t extent = 1;
  int64_t stride = 0;
  std::vector<int64_t> outer_extents, outer_strides;
  int64_t outer_size = 1;
};

// The mode `mode` (negative counts from the end) of a tensor of `rank` modes as an index (ValueError naming `op`).
size_t normalized_mode(int64_t mode, size_t rank, const char* op);
// `layout` along mode `m`: ValueError when the mode is hierarchical and its leaves do not coalesce into one stride.
RowGeometry row_geometry(const Layout& layout, size_t m, const char* op);
// The dense layout of a row operation's result of `shape`: row-major when `like` is (its last mode contiguous,
// its first not), else column-major.
Layout row_result_layout(const Layout& like, const Shape& shape);
// A fresh dense result of `shape` and `dtype` on `prototype`'s kind, laid out per row_result_layout.
TensorPtr row_result(const TensorImpl& like, const Shape& shape, const DType& dtype);
// `shape` with top-level mode `m`'s extent replaced by `extent` (a leaf).
Shape with_extent(const Shape& shape, size_t m, int64_t extent);
// The values of a validated one-mode Int32 index tensor.
std::vector<int32_t> index_values(const TensorImpl& indices);

// Validation of a row operation's operands and options (call_op's shape check; ValueError, TypeError, IndexError):
// everything is checked before any result is allocated.
void check_row_operands(const OpDef& def, std::span<const Operand> ops, const OpOptions& options);

// Kernel entries (KernelFn): the CPU backend's (rows_cpu.cpp) and the Generic backend's (rows_generic.cpp).
TensorPtr cpu_softmax(std::span<const Operand> ops, const OpOptions& options, const OpDef& def);
TensorPtr cpu_topk(std::span<const Operand> ops, const OpOptions& options, const OpDef& def);
TensorPtr cpu_index_select(std::span<const Operand> ops, const OpOptions& options, const OpDef& def);
TensorPtr cpu_index_add(std::span<const Operand> ops, const OpOptions& options, const OpDef& def);
TensorPtr generic_softmax(std::span<const Operand> ops, const OpOptions& options, const OpDef& def);
TensorPtr generic_topk(std::span<const Operand> ops, const OpOptions& options, const OpDef& def);
TensorPtr generic_index_select(std::span<const Operand> ops, const OpOptions& options, const OpDef& def);
TensorPtr generic_index_add(std::span<const Operand> ops, const OpOptions& options, const OpDef& def);

// The VJPs' kernels on host memory (rows_cpu.cpp): Float32 results of `x`'s shape on `prototype`'s kind.
// softmax: y (g - sum(g y)) along mode m, y recomputed from x in Float32.
TensorPtr softmax_backward(const TensorImpl& x, const TensorImpl& g, size_t m, const Carrier& prototype);
// topk: g (k along mode m) scattered into zeros of `shape` at `indices` (Int32, g's shape).
TensorPtr topk_backward(const TensorImpl& g, const TensorImpl& indices, const Shape& shape, size_t m,
                        const Carrier& prototype);
// exp(x) for x <= 0 in Float32 (relative error at most 2^-23; Note [Row operations]); exposed for its test.
float row_exp(float x) noexcept;
// The row loops' kernel on this machine: "avx512f" or "portable".
const char* row_kernel_path();
// Forces the portable row loops (true) or restores run-time dispatch (false), so tests can run both paths on a
// machine that has AVX-512. Returns the previous setting.
bool force_portable_row_kernels(bool on) noexcept;

// VjpFn: the row operations' VJPs (rows.cpp).
void vjp_softmax(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_topk(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_index_select(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_index_add(const VjpArgs& args, std::span<TensorPtr> grads);

}  // namespace sw::detail
