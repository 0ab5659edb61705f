// The operation table's lookups (Note [The operation table]), broadcasting, reduce_sum descriptions and the
// dtype rules (docs/guide.md, "Operations and autograd").
#include <algorithm>
#include <sstream>

#include "op_table.hpp"
#include "strideweave/errors.hpp"

namespace sw {

// ---------------------------------------------------------------- the table

const OpDef& op_def(OpId id) { return detail::kOps[static_cast<size_t>(id)]; }
const std::array<OpDef, kOpCount>& op_table() { return detail::kOps; }
std::optional<OpId> op_from_name(std::string_view name) {
  for (const auto& d : detail::kOps)
    if (name == d.name) return d.id;
  return std::nullopt;
}

// ---------------------------------------------------------------- shapes

namespace {
IntTuple broadcast_tree(const IntTuple& a, const IntTuple& b, bool& ok) {
  // Note [Compatible shapes] (layout.hpp): a leaf meets a nested mode of its size (refined), or of any size
  // (extent 1); the result takes the nested mode.
  if (a.is_leaf() && !b.is_leaf()) {
    if (a.value() == 1 || a.value() == Shape(b).size()) return b;
    ok = false;
    return a;
  }
  if (!a.is_leaf() && b.is_leaf()) {
    if (b.value() == 1 || b.value() == Shape(a).size()) return a;
    ok = false;
    return a;
  }
  if (!a.is_leaf() && a.rank() != b.rank()) {
    ok = false;
    return a;
  }
  if (a.is_leaf()) {
    if (a.value() == b.value() || b.value() == 1) return a;
    if (a.value() == 1) return b;
    ok = false;
    return a;
  }
  std::vector<IntTuple> out;
  for (size_t k = 0; k < a.rank(); ++k) out.push_back(broadcast_tree(a[k], b[k], ok));
  return IntTuple::tuple(std::move(out));
}
}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  bool ok = true;
  IntTuple t = broadcast_tree(a.tree(), b.tree(), ok);
  if (!ok)
    raise<ValueError>(op, ": shapes ", a.str(), " and ", b.str(),
                      " do not broadcast (mode by mode: equal extents or 1, a leaf matching a nested mode of its size; "
                      "Note [Compatible shapes])");
  return Shape(t);
}

std::vector<size_t> parse_reduce_description(const std::optional<std::string>& description, size_t rank) {
  std::vector<size_t> kept;
  if (!description) {
    if (rank > 0) kept.push_back(0);
    return kept;
  }
  const std::string& d = *description;
  auto arrow = d.find("->");
  if (arrow == std::string::npos || d.find("->", arrow + 2) != std::string::npos)
    raise<ValueError>("reduce_sum description '", d, "' must look like 'a b -> a'");
  auto words = [](const std::string& s) {
    std::istringstream in(s);
    std::vector<std::string> out;
    for (std::string w; in >> w;) out.push_back(w);
    return out;
  };
  auto left = words(d.substr(0, arrow));
  auto right = words(d.substr(arrow + 2));
  if (left.size() != rank)
    raise<ValueError>("reduce_sum description '", d, "' names ", left.size(), " modes but the tensor has ", rank);
  for (size_t i = 0; i < left.size(); ++i)
    for (size_t j = i + 1; j < left.size(); ++j)
      if (left[i] == left[j]) raise<ValueError>("reduce_sum description '", d, "' repeats the name '", left[i], "'");
  for (const auto& w : right) {
    auto it = std::find(left.begin(), left.end(), w);
    if (it == left.end()) raise<ValueError>("reduce_sum description '", d, "' keeps unknown name '", w, "'");
    size_t k = static_cast<size_t>(it - left.begin());
    if (std::find(kept.begin(), kept.end(), k) != kept.end())
      raise<ValueError>("reduce_sum description '", d, "' keeps '", w, "' twice");
    kept.push_back(k);
  }
  return kept;
}

// ---------------------------------------------------------------- dtypes

const DType& result_dtype(OpId id, std::span<const Operand> ops, const OpOptions& options) {
  return op_def(id).result_dtype(ops, options);
}

namespace detail {

namespace {
bool all_int32(std::span<const Operand> ops) {
  for (const auto& o : ops) {
    if (o.is_tensor() ? o.tensor->dtype().id() != DTypeId::Int32
                      : (o.scalar.kind != Value::Kind::Int && o.scalar.kind != Value::Kind::BigInt))
      return false;
  }
  return true;
}

// The float dtype of a mix (docs/guide.md, "DTypes"): a 16-bit float dtype when it is the only float dtype among
// the tensor operands (Int32 and Bool tensors and weak scalars do not promote it), Float32 otherwise (any Float32
// operand, BFloat16 with Float16, or no float operand at all).
const DType& float_dtype(std::span<const Operand> ops) {
  const DType* half = nullptr;
  for (const auto& o : ops) {
    if (!o.is_tensor()) continue;
    const DType& d = o.tensor->dtype();
    if (d.id() == DTypeId::Float32) return DType::Float32();
    if (d.is_half()) {
      if (half && half != &d) return DType::Float32();
      half = &d;
    }
  }
  return half ? *half : DType::Float32();
}
}  // namespace

const DType& dtype_int_or_float(std::span<const Operand> ops, const OpOptions&) {
  return all_int32(ops) ? DType::Int32() : float_dtype(ops);
}
const DType& dtype_float(std::span<const Operand> ops, const OpOptions&) { return float_dtype(ops); }
const DType& dtype_of_operand(std::span<const Operand> ops, const OpOptions&) { return ops[0].tensor->dtype(); }
const DType& dtype_signed(std::span<const Operand> ops, const OpOptions&) {
  return ops[0].tensor->dtype().id() == DTypeId::Int32 ? DType::Int32() : float_dtype(ops);
}
const DType& dtype_sum(std::span<const Operand> ops, const OpOptions& options) {
  return options.accumulate_f64 ? DType::Float32() : ops[0].tensor->dtype();
}
const DType& dtype_product(std::span<const Operand> ops, const OpOptions& options) {
  if (options.accumulate_f64) return DType::Float32();
  return all_int32(ops) ? DType::Int32() : float_dtype(ops);
}

}  // namespace detail

}  // namespace sw
