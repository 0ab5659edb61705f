// strideweave/ops.hpp — the operation table, dtype plans, broadcasting and dispatch.
//
// Six central operations (add, elementwise_mul, mul, relu, reduce_sum, matmul)
// plus sub, div, neg, exp for ordinary tensors. One table entry per operation
// carries its name, arity and VJP; the table is guarded so a half-added
// operation fails to compile (see kOpCount and the static_assert in ops.cpp).
//
// Semantics (docs/guide.md, "Operations and autograd"):
//  - Operands are tensors; `mul` also takes a weak scalar on either side.
//    Tensor operands share one exact carrier kind ("Tensor backing carriers
//    must match", TypeError); there is no implicit movement.
//  - Broadcasting: same hierarchical profile; each leaf extent equal or 1.
//  - Dtypes: Int32 with Int32 stays Int32 (overflow -> OverflowError); any other
//    mix gives Float32; weak int with Int32 stays Int32, weak float gives
//    Float32; relu/reduce_sum keep the dtype; accumulator Float64 accumulates
//    in double and returns Float32.
//  - Results are fresh dense carriers of the dispatching (first tensor
//    operand's) kind at offset 0.
//
// Execution goes through a per-kind OpBackend: Generic runs the reference
// loops, CPU the fast kernels (contiguous fast paths, threads, BLAS),
// Evictable its primary tier's backend. Later layers (TiledEvictable)
// register their own backend for their kind without touching this file.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strideweave/tensor.hpp"

namespace sw {

enum class OpId : uint8_t { Add, ElementwiseMul, Mul, Relu, ReduceSum, Matmul, Sub, Div, Neg, Exp };
inline constexpr size_t kOpCount = 10;

struct OpDef {
  OpId id;
  const char* name;
  int arity;       // operand count
  bool central;    // one of the six operations every executing carrier (and TiledEvictable) accepts
  bool weak_scalars;  // accepts a weak scalar operand (mul)
};

const OpDef& op_def(OpId id);
std::optional<OpId> op_from_name(std::string_view name);
const std::array<OpDef, kOpCount>& op_table();

// A tensor or a weak scalar (a Python number: it never receives a gradient).
struct Operand {
  TensorPtr tensor;
  Value scalar;
  bool is_tensor() const { return tensor != nullptr; }
  static Operand of(TensorPtr t) { return {std::move(t), {}}; }
  static Operand weak(Value v) { return {nullptr, v}; }
};

struct OpOptions {
  std::optional<std::string> description;  // reduce_sum: "a b -> a"
  bool accumulate_f64 = false;             // accumulator_dtype=DType.Float64
};

// Executes an operation for one carrier kind (no autograd, operands validated).
class OpBackend {
 public:
  virtual ~OpBackend() = default;
  virtual TensorPtr forward(OpId id, std::span<const Operand> operands, const OpOptions& options) = 0;
  // Whether this backend executes `id` (capabilities and dispatch_op).
  virtual bool supports(OpId id) const = 0;
  // Whether it executes `id` for this carrier of its kind. A kind whose execution
  // depends on its tiers (Evictable runs on its primary's backend) refines it.
  virtual bool executes(const Carrier& carrier, OpId id) const { return supports(id); }
  // Backward of an operation this backend ran: kinds that compute on a dense
  // copy of their operands (TiledEvictable) materialise each input for the
  // VJP, then turn each dense input gradient into a gradient of the input's
  // own kind and shape.
  virtual bool materializes() const { return false; }
  virtual TensorPtr materialize_for_backward(const TensorPtr& input) { return input; }
  virtual TensorPtr gradient_from_dense(const TensorPtr& input, const TensorPtr& dense_grad) { return dense_grad; }

  // Gradient accumulation belongs to the kind (Note [Gradients of a kind] in autograd.cpp); the autograd engine
  // asks the backend of the gradient's kind and knows no kind itself.
  // a + b, two gradients of this backend's kind (a's carrier), as a gradient of a's kind, geometry and layout;
  // null to let the engine add them with the central add (the default).
  virtual TensorPtr add_gradients(const TensorPtr& a, const TensorPtr& b) { return nullptr; }
  // Adds `g` into `current`, a leaf's .grad of this backend's kind, in place; false (the default) when it
  // cannot, and the engine then stores a fresh sum. The engine holds `current` exactly once beside the leaf's
  // .grad (so `current.use_count() == 2` means nobody else holds that tensor); `owned`: nobody else holds `g`.
  virtual bool accumulate_in_place(const TensorPtr& current, const TensorPtr& g, bool owned) { return false; }
};

void register_backend(const CarrierKind* kind, std::shared_ptr<OpBackend> backend);
OpBackend* backend_for(const CarrierKind& kind);

// Validates operands (types, carrier kinds, released carriers, profiles,
// dtypes) and runs the operation, recording an autograd node when grad mode
// is on and a differentiable input and result exist.
TensorPtr call_op(OpId id, std::span<const Operand> operands, const OpOptions& options = {});

// The result dtype of a validated operand list.
const DType& result_dtype(OpId id, std::span<const Operand> operands, const OpOptions& options);
// The broadcast result shape of elementwise operands (ValueError when incompatible).
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

// reduce_sum description: kept top-level modes of the input, in result order.
std::vector<size_t> parse_reduce_description(const std::optional<std::string>& description, size_t rank);

// Capabilities: one entry per accepted operand signature.
struct OperandSignature {
  bool weak_scalar;
  const DType* dtype;
};
struct Capability {
  OpId op;
  std::vector<OperandSignature> operands;
};
std::vector<Capability> operation_capabilities(const Carrier& carrier, std::optional<OpId> only);

// Helpers shared by backends and VJPs.
TensorPtr dense_result(const Carrier& prototype, const Shape& shape, const DType& dtype);
// A view with top-level modes reordered (no copy).
TensorPtr permute_modes(const TensorPtr& t, const std::vector<size_t>& order);
// A tensor filled with `value` of `shape` on `prototype`'s kind.
TensorPtr full_like_kind(const Carrier& prototype, const Shape& shape, const DType& dtype, double value);
// Sums `grad` over the leaves broadcast from `target` (the VJP of broadcasting).
TensorPtr unbroadcast(const TensorPtr& grad, const Shape& target);
// Repeats `t` (of shape `from`) along stride-0 leaves to `to` as a dense result.
TensorPtr expand_dense(const TensorPtr& t, const Shape& to);

}  // namespace sw
