// strideweave/ops.hpp — the operation table, dtype plans, broadcasting and dispatch.
//
// Six central operations (add, elementwise_mul, mul, relu, reduce_sum, matmul)
// plus sub, div, neg, exp for ordinary tensors, and the activations silu and
// sigmoid (central too: a TiledEvictable executes them). One table row per
// operation carries all of it (Note [The operation table]); a half-added
// operation fails to compile.
//
// Semantics (docs/guide.md, "Operations and autograd"):
//  - Operands are tensors; every element-wise binary operation (add, sub,
//    mul, elementwise_mul, div) also takes a weak scalar (a Python number) on
//    either side, never both; matmul takes tensors only.
//    Tensor operands share one exact carrier kind ("Tensor backing carriers
//    must match", TypeError); there is no implicit movement.
//  - Broadcasting: same hierarchical profile; each leaf extent equal or 1.
//  - Dtypes: Int32 with Int32 stays Int32 (overflow -> OverflowError); any other
//    mix gives the float dtype: BFloat16 (Float16) when it is the only float
//    dtype among the tensor operands, else Float32 (docs/guide.md, "DTypes");
//    weak int with Int32 stays Int32, weak float gives the float dtype (weak
//    scalars never promote: `t + 2.0` of a BFloat16 t is BFloat16, of an
//    Int32 t Float32; `1 / t` of an Int32 t is Float32, as div always is; the
//    scalar enters the operation as a Float32 value, or Int32 for an Int32
//    result); silu/sigmoid/exp/div give the float dtype (Int32 -> Float32);
//    relu/reduce_sum keep the dtype; accumulator
//    Float64 accumulates in double and returns Float32.
//  - Results are fresh dense carriers of the dispatching (first tensor
//    operand's) kind at offset 0.
//
// Execution goes through a per-kind OpBackend: Generic runs the reference
// loops, CPU the fast kernels (contiguous fast paths, threads, BLAS),
// Evictable its primary tier's backend. Later layers (TiledEvictable)
// register their own backend for their kind without touching this file.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strideweave/tensor.hpp"

namespace sw {

enum class OpId : uint8_t {
  Add, ElementwiseMul, Mul, Relu, ReduceSum, Matmul, Sub, Div, Neg, Exp,
  // activations
  Silu, Sigmoid,
  // row operations (Note [Row operations] in cpp/src/ops/rows.cpp)
  Softmax, TopK, IndexSelect, IndexAdd,
  Count  // not an operation: the number of them (the table has one row per value before it)
};
inline constexpr size_t kOpCount = static_cast<size_t>(OpId::Count);

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
  // row operations (Note [Row operations] in cpp/src/ops/rows.cpp)
  int64_t mode = 0;              // the mode a row operation works along (kOpMode; negative counts from the end)
  int64_t k = 0;                 // topk's k (kOpK)
  TensorPtr* second = nullptr;   // where a row with two results (OpShape::TopK) puts its second (the indices)
};

// ---------------------------------------------------------------- the operation table
//
// Note [The operation table]: one row (an OpDef) per OpId holds everything that
// makes an operation one: its name and operand names, its flags, how its result
// shape follows from its operands (OpShape: element-wise or not), its dtype rule,
// what its node saves for backward, its VJP and its kernel entries for the CPU
// and Generic backends. Nothing else decides a per-operation property (no
// switch with a default). The table (cpp/src/ops/op_table.hpp) is constexpr and
// guarded by static_asserts: OpDef has no default constructor, so a row with a
// missing part, or a missing row, does not compile; the asserts check that rows
// follow OpId order, names are unique, every differentiable row has a VJP and
// every row its dtype rule and kernels. Adding an operation is adding a value
// to OpId and a row to the table, plus the functions the row names.
// Row operations (along one mode, with k, index operands or two results) have
// shape rules and options of their own: Note [Row operations] in
// cpp/src/ops/rows.cpp.

struct OpDef;
struct VjpArgs;  // what a VJP reads (cpp/src/ops/vjps.hpp)

// How the result shape follows from the operands.
enum class OpShape : uint8_t {
  Elementwise,  // the broadcast of the tensor operands' shapes (docs/guide.md, broadcasting)
  Reduction,    // the kept modes of one operand (reduce_sum's description)
  Contraction,  // (lhs mode 0, rhs mode 0), contracting mode 1 of both (matmul)
  // row operations (Note [Row operations] in cpp/src/ops/rows.cpp): OpOptions::mode names the mode
  AlongMode,    // the operand's shape (softmax)
  TopK,         // the operand's shape with the mode's extent k; two results: values and Int32 indices (topk)
  Gather,       // (t, indices): t's shape with the mode's extent len(indices) (index_select)
  Scatter,      // (t, indices, source): t's shape; source is t's shape with the mode's extent len(indices) (index_add)
};

// What the operation's node saves for backward (their versions are checked before its VJP runs).
enum class OpSaves : uint8_t {
  Nothing,  // the VJP reads only the output gradient and the inputs' shapes
  Inputs,   // the VJP reads the tensor operands' values
};

// Row flags (OpDef::flags).
inline constexpr uint8_t kOpCentral = 1;         // one of the operations every executing carrier accepts
inline constexpr uint8_t kOpWeakScalars = 2;     // accepts a weak scalar operand (every element-wise binary one)
inline constexpr uint8_t kOpDifferentiable = 4;  // records a node with its VJP
inline constexpr uint8_t kOpDescription = 8;     // takes OpOptions::description (reduce_sum)
inline constexpr uint8_t kOpAccumulator = 16;    // takes OpOptions::accumulate_f64 (accumulator_dtype)
// row operations (Note [Row operations] in cpp/src/ops/rows.cpp)
inline constexpr uint8_t kOpMode = 32;           // takes OpOptions::mode
inline constexpr uint8_t kOpK = 64;              // takes OpOptions::k

// The result dtype of validated operands (docs/guide.md, "Operations and autograd").
using DTypeRule = const DType& (*)(std::span<const Operand> operands, const OpOptions& options);
// Gradients of the tensor operands (`grads`, one slot per tensor operand, left null where none flows).
using VjpFn = void (*)(const VjpArgs& args, std::span<TensorPtr> grads);
// Runs the operation on validated operands of one native kind (CPU or Generic) into a fresh dense result.
using KernelFn = TensorPtr (*)(std::span<const Operand> operands, const OpOptions& options, const OpDef& def);

// A function part of a row and whether the row gives one (a literal nullptr: none). Whether it is given is known
// at compile time even where the function's address is not a constant expression (sanitizer builds may not assume
// that a function defined in another file has a non-null address), so the table's guards test `given`.
template <class Fn>
struct OpPart {
  Fn fn;
  bool given;
  constexpr OpPart(Fn f) : fn(f), given(true) {}                 // NOLINT: a row names the function
  constexpr OpPart(std::nullptr_t) : fn(nullptr), given(false) {}  // NOLINT: a row says "none"
};

struct OpDef {
  // Every part is a constructor argument: a row cannot leave one out (Note [The operation table]).
  constexpr OpDef(OpId id_, const char* name_, std::array<const char*, 3> operand_names_, uint8_t flags_,
                  OpShape shape_, OpSaves saves_, OpPart<DTypeRule> result_dtype_, OpPart<VjpFn> vjp_,
                  OpPart<KernelFn> cpu_, OpPart<KernelFn> generic_)
      : id(id_),
        name(name_),
        operand_names(operand_names_),
        arity(operand_names_[2] ? 3 : operand_names_[1] ? 2 : 1),
        flags(flags_),
        central((flags_ & kOpCentral) != 0),
        weak_scalars((flags_ & kOpWeakScalars) != 0),
        shape(shape_),
        saves(saves_),
        result_dtype(result_dtype_.fn),
        vjp(vjp_.fn),
        cpu(cpu_.fn),
        generic(generic_.fn),
        has_result_dtype(result_dtype_.given),
        has_vjp(vjp_.given),
        has_kernels(cpu_.given && generic_.given) {}

  OpId id;
  const char* name;
  std::array<const char*, 3> operand_names;  // the Python parameter names ("a", "b"; "t"; "lhs", "rhs"), unused null
  int arity;                                 // operand count (named operands)
  uint8_t flags;                             // kOp* bits
  bool central;                              // flags & kOpCentral
  bool weak_scalars;                         // flags & kOpWeakScalars
  OpShape shape;
  OpSaves saves;
  DTypeRule result_dtype;
  VjpFn vjp;                                 // null exactly when not differentiable
  KernelFn cpu;                              // the CPU backend's kernel entry
  KernelFn generic;                          // the Generic backend's (reference) kernel entry
  bool has_result_dtype, has_vjp, has_kernels;  // which function parts the row gives (OpPart::given)

  constexpr bool elementwise() const { return shape == OpShape::Elementwise; }
  constexpr bool differentiable() const { return (flags & kOpDifferentiable) != 0; }
  constexpr bool takes_description() const { return (flags & kOpDescription) != 0; }
  constexpr bool takes_accumulator() const { return (flags & kOpAccumulator) != 0; }
  // row operations (Note [Row operations] in cpp/src/ops/rows.cpp)
  constexpr bool takes_mode() const { return (flags & kOpMode) != 0; }
  constexpr bool takes_k() const { return (flags & kOpK) != 0; }
  constexpr int results() const { return shape == OpShape::TopK ? 2 : 1; }
};

const OpDef& op_def(OpId id);
std::optional<OpId> op_from_name(std::string_view name);
const std::array<OpDef, kOpCount>& op_table();

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

// row operations (Note [Row operations] in cpp/src/ops/rows.cpp; docs/guide.md, "Row operations"). `mode` counts
// from the end when negative; `indices` is a one-mode Int32 tensor of t's carrier kind.
TensorPtr softmax(const TensorPtr& t, int64_t mode);
std::pair<TensorPtr, TensorPtr> topk(const TensorPtr& t, int64_t k, int64_t mode);  // (values, Int32 indices)
TensorPtr index_select(const TensorPtr& t, int64_t mode, const TensorPtr& indices);
TensorPtr index_add(const TensorPtr& t, int64_t mode, const TensorPtr& indices, const TensorPtr& source);

}  // namespace sw
