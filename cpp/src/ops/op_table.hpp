// Internal: the operation table, one row per OpId (Note [The operation table]
// in strideweave/ops.hpp), and the compile-time guards over it.
#pragma once

#include <array>

#include "kernels.hpp"
#include "rows.hpp"
#include "strideweave/ops.hpp"
#include "vjps.hpp"

namespace sw::detail {

// Dtype rules (rules.cpp), DTypeRule.
// "the float dtype": a 16-bit float when it is the only float dtype among the tensor operands, else Float32.
const DType& dtype_int_or_float(std::span<const Operand> ops, const OpOptions&);  // Int32 when all are Int32
const DType& dtype_float(std::span<const Operand> ops, const OpOptions&);         // the float dtype
const DType& dtype_of_operand(std::span<const Operand> ops, const OpOptions&);    // the operand's
const DType& dtype_signed(std::span<const Operand> ops, const OpOptions&);        // Int32 stays, else the float dtype
const DType& dtype_sum(std::span<const Operand> ops, const OpOptions& options);   // the operand's; Float32 with F64
const DType& dtype_product(std::span<const Operand> ops, const OpOptions& options);  // int or float; F64: Float32

inline constexpr uint8_t kCentralOp = kOpCentral | kOpDifferentiable;
inline constexpr uint8_t kOtherOp = kOpDifferentiable;

// clang-format off
inline constexpr std::array<OpDef, kOpCount> kOps{{
    // OpDef(id, name, operand names, flags, shape rule, saved for backward,
    //       dtype rule, VJP, CPU kernel entry, Generic kernel entry)
    OpDef(OpId::Add, "add", {"a", "b"}, kCentralOp | kOpWeakScalars, OpShape::Elementwise, OpSaves::Nothing,
          &dtype_int_or_float, &vjp_add, &elementwise<cpu::add>, &elementwise<generic::add>),
    OpDef(OpId::ElementwiseMul, "elementwise_mul", {"a", "b"}, kCentralOp | kOpWeakScalars, OpShape::Elementwise, OpSaves::Inputs,
          &dtype_int_or_float, &vjp_mul, &elementwise<cpu::mul>, &elementwise<generic::mul>),
    OpDef(OpId::Mul, "mul", {"a", "b"}, kCentralOp | kOpWeakScalars, OpShape::Elementwise, OpSaves::Inputs,
          &dtype_int_or_float, &vjp_mul, &elementwise<cpu::mul>, &elementwise<generic::mul>),
    OpDef(OpId::Relu, "relu", {"t"}, kCentralOp, OpShape::Elementwise, OpSaves::Inputs,
          &dtype_of_operand, &vjp_relu, &elementwise<cpu::relu>, &elementwise<generic::relu>),
    OpDef(OpId::ReduceSum, "reduce_sum", {"t"}, kCentralOp | kOpDescription | kOpAccumulator, OpShape::Reduction, OpSaves::Nothing,
          &dtype_sum, &vjp_reduce_sum, &reduction<cpu_reduce_sum>, &reduction<generic_reduce_sum>),
    OpDef(OpId::Matmul, "matmul", {"lhs", "rhs"}, kCentralOp | kOpAccumulator, OpShape::Contraction, OpSaves::Inputs,
          &dtype_product, &vjp_matmul, &contraction<cpu_matmul>, &contraction<generic_matmul>),
    OpDef(OpId::Sub, "sub", {"a", "b"}, kOtherOp | kOpWeakScalars, OpShape::Elementwise, OpSaves::Nothing,
          &dtype_int_or_float, &vjp_sub, &elementwise<cpu::sub>, &elementwise<generic::sub>),
    OpDef(OpId::Div, "div", {"a", "b"}, kOtherOp | kOpWeakScalars, OpShape::Elementwise, OpSaves::Inputs,
          &dtype_float, &vjp_div, &elementwise<cpu::div>, &elementwise<generic::div>),
    OpDef(OpId::Neg, "neg", {"t"}, kOtherOp, OpShape::Elementwise, OpSaves::Nothing,
          &dtype_signed, &vjp_neg, &elementwise<cpu::neg>, &elementwise<generic::neg>),
    OpDef(OpId::Exp, "exp", {"t"}, kOtherOp, OpShape::Elementwise, OpSaves::Inputs,
          &dtype_float, &vjp_exp, &elementwise<cpu::exp>, &elementwise<generic::exp>),
    // activations (activations.hpp): stable for every finite input
    OpDef(OpId::Silu, "silu", {"t"}, kCentralOp, OpShape::Elementwise, OpSaves::Inputs,
          &dtype_float, &vjp_silu, &elementwise<cpu::silu>, &elementwise<generic::silu>),
    OpDef(OpId::Sigmoid, "sigmoid", {"t"}, kCentralOp, OpShape::Elementwise, OpSaves::Inputs,
          &dtype_float, &vjp_sigmoid, &elementwise<cpu::sigmoid>, &elementwise<generic::sigmoid>),
    // row operations (Note [Row operations] in rows.cpp): topk saves its second result (its indices) itself
    OpDef(OpId::Softmax, "softmax", {"t"}, kOtherOp | kOpMode, OpShape::AlongMode, OpSaves::Inputs,
          &dtype_of_operand, &vjp_softmax, &cpu_softmax, &generic_softmax),
    OpDef(OpId::TopK, "topk", {"t"}, kOtherOp | kOpMode | kOpK, OpShape::TopK, OpSaves::Nothing,
          &dtype_of_operand, &vjp_topk, &cpu_topk, &generic_topk),
    OpDef(OpId::IndexSelect, "index_select", {"t", "indices"}, kOtherOp | kOpMode, OpShape::Gather, OpSaves::Inputs,
          &dtype_of_operand, &vjp_index_select, &cpu_index_select, &generic_index_select),
    OpDef(OpId::IndexAdd, "index_add", {"t", "indices", "source"}, kOtherOp | kOpMode, OpShape::Scatter, OpSaves::Inputs,
          &dtype_of_operand, &vjp_index_add, &cpu_index_add, &generic_index_add),
}};
// clang-format on

// ---------------------------------------------------------------- guards (checked at compile time)

constexpr bool same_name(const char* a, const char* b) {
  for (; *a && *a == *b; ++a, ++b) {
  }
  return *a == *b;
}

// Rows in OpId order: kOps[i] describes OpId i (op_def indexes by id). A missing row does not compile
// (OpDef has no default constructor), nor does a row missing a part (no constructor takes fewer).
constexpr bool rows_in_id_order() {
  for (size_t i = 0; i < kOps.size(); ++i)
    if (static_cast<size_t>(kOps[i].id) != i) return false;
  return true;
}
static_assert(kOps.size() == kOpCount && rows_in_id_order(), "the operation table needs one row per OpId, in order");

constexpr bool names_unique_and_set() {
  for (size_t i = 0; i < kOps.size(); ++i) {
    if (kOps[i].name == nullptr || kOps[i].name[0] == '\0') return false;
    for (size_t j = i + 1; j < kOps.size(); ++j)
      if (same_name(kOps[i].name, kOps[j].name)) return false;
  }
  return true;
}
static_assert(names_unique_and_set(), "every operation needs a name of its own");

constexpr bool operands_named() {
  for (const OpDef& d : kOps)
    if (d.operand_names[0] == nullptr || (d.arity >= 2) != (d.operand_names[1] != nullptr) ||
        (d.arity == 3) != (d.operand_names[2] != nullptr))
      return false;
  return true;
}
static_assert(operands_named(), "every operand of an operation needs a (Python parameter) name");

constexpr bool kernels_and_rules_set() {
  for (const OpDef& d : kOps)
    if (!d.has_result_dtype || !d.has_kernels) return false;
  return true;
}
static_assert(kernels_and_rules_set(), "every operation needs a dtype rule and CPU and Generic kernel entries");

// A differentiable operation has its VJP; one that is not has none (and saves nothing).
constexpr bool vjps_match_flags() {
  for (const OpDef& d : kOps) {
    if (d.differentiable() != d.has_vjp) return false;
    if (!d.differentiable() && d.saves != OpSaves::Nothing) return false;
  }
  return true;
}
static_assert(vjps_match_flags(), "a differentiable operation needs its VJP (and only it has one)");

// What each shape rule and option assumes: element-wise operations are unary or binary, and exactly the
// binary ones take weak scalars (a Python number on either side); a reduction has one operand, a contraction
// two; only a reduction takes a description; only reductions and contractions take an accumulator dtype.
constexpr bool shapes_consistent() {
  for (const OpDef& d : kOps) {
    if (d.weak_scalars != (d.elementwise() && d.arity == 2)) return false;
    if (d.shape == OpShape::Reduction && d.arity != 1) return false;
    if (d.shape == OpShape::Contraction && d.arity != 2) return false;
    if (d.takes_description() && d.shape != OpShape::Reduction) return false;
    if (d.takes_accumulator() && d.elementwise()) return false;
  }
  return true;
}
static_assert(shapes_consistent(), "an operation's flags disagree with its shape rule or arity");

// row operations (Note [Row operations] in rows.cpp): a row shape rule exactly when the row takes a mode; k only
// for topk's rule; the operand count each rule reads (one; t and indices; t, indices and source), and only
// index_add has three; a row with two results saves nothing through OpSaves (call_op saves its second result).
constexpr bool is_row_shape(OpShape s) {
  return s == OpShape::AlongMode || s == OpShape::TopK || s == OpShape::Gather || s == OpShape::Scatter;
}
constexpr bool row_operations_consistent() {
  for (const OpDef& d : kOps) {
    if (is_row_shape(d.shape) != d.takes_mode()) return false;
    if (d.takes_k() != (d.shape == OpShape::TopK)) return false;
    if ((d.shape == OpShape::AlongMode || d.shape == OpShape::TopK) && d.arity != 1) return false;
    if (d.shape == OpShape::Gather && d.arity != 2) return false;
    if ((d.shape == OpShape::Scatter) != (d.arity == 3)) return false;
    if (d.results() == 2 && (d.saves != OpSaves::Nothing || !d.differentiable())) return false;
    if (d.takes_mode() && (d.weak_scalars || d.takes_description() || d.takes_accumulator())) return false;
  }
  return true;
}
static_assert(row_operations_consistent(), "a row operation's flags disagree with its shape rule or arity");

}  // namespace sw::detail
