// The reference kernels of the Generic carrier: the simplest obviously-correct
// loops, one element at a time, in double (floats) or int64 (Int32). They are
// the oracle the fast kernels are tested against, not a fast path.
#include <cmath>
#include <functional>
#include <limits>

#include "activations.hpp"
#include "kernels.hpp"
#include "strideweave/errors.hpp"

namespace sw::detail {

namespace {

// Element `ordinal` of a broadcast operand (strides per result leaf).
Value element(const KernelInput& in, const std::vector<int64_t>& ext, int64_t ordinal) {
  if (!in.carrier) return in.scalar;
  int64_t off = in.offset;
  for (size_t j = 0; j < ext.size(); ++j) {
    off += (ordinal % ext[j]) * in.strides[j];
    ordinal /= ext[j];
  }
  return in.carrier->read_value(off);
}

double as_double(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Int: return static_cast<double>(v.i);
    case Value::Kind::Bool: return v.b ? 1.0 : 0.0;
    default: return v.f;
  }
}

int64_t as_int(const Value& v) { return v.kind == Value::Kind::Bool ? (v.b ? 1 : 0) : v.i; }

// A float result is written as Float32 computes it (`f` rounded to binary32; a 16-bit result then rounds that once,
// Note [16-bit floats]), or, for a sum (`exact_sum`), as the double sum rounded once to the result dtype.
void write_result(Carrier& out, int64_t i, double f, int64_t n, bool integer, bool exact_sum = false) {
  const DType& d = out.dtype();
  if (d.id() == DTypeId::Int32) {
    if (n < std::numeric_limits<int32_t>::min() || n > std::numeric_limits<int32_t>::max())
      raise<OverflowError>("Int32 result overflows");
    out.write_value(i, Value::from_int(n));
  } else if (d.id() == DTypeId::Bool) {
    out.write_value(i, Value::from_bool(integer ? n != 0 : f != 0.0));
  } else {  // write_value stores what it is given: the value is converted (rounded) to the result dtype first
    out.write_value(i, d.convert(Value::from_float(exact_sum && d.is_half() ? f : static_cast<double>(static_cast<float>(f)))));
  }
}

// One element at a time, in double (`f`) and in int64 (`i`, for Int32 and Bool results); the result dtype
// picks which is written. A unary `f` also takes the operand's dtype.
template <int Arity, class F, class I>
void generic_map(const ElementwiseCall& c, F f, I i) {
  const std::vector<int64_t>& ext = c.result_extents;
  int64_t n = 1;
  for (auto e : ext) n *= e;
  const bool integer = !c.out.dtype().is_floating();
  for (int64_t k = 0; k < n; ++k) {
    Value a = element(c.in[0], ext, k);
    if constexpr (Arity == 2) {
      Value b = element(c.in[1], ext, k);
      write_result(c.out, k, f(as_double(a), as_double(b)), i(as_int(a), as_int(b)), integer);
    } else {
      write_result(c.out, k, f(as_double(a), c.in[0].dtype), i(as_int(a)), integer);
    }
  }
}

constexpr auto no_int = [](auto...) { return int64_t{0}; };  // an operation whose result is always Float32

}  // namespace

// The Generic backend's element-wise kernels, named by the table's rows (Note [The operation table]).
namespace generic {
void add(const ElementwiseCall& c) { generic_map<2>(c, std::plus<double>{}, std::plus<int64_t>{}); }
void sub(const ElementwiseCall& c) { generic_map<2>(c, std::minus<double>{}, std::minus<int64_t>{}); }
void mul(const ElementwiseCall& c) { generic_map<2>(c, std::multiplies<double>{}, std::multiplies<int64_t>{}); }
void div(const ElementwiseCall& c) { generic_map<2>(c, std::divides<double>{}, no_int); }
void relu(const ElementwiseCall& c) {
  // +0 at or below zero, else x itself: NaN passes through, as PyTorch's relu (cpu_kernels.cpp's ReluF)
  generic_map<1>(c, [](double x, DTypeId) { return x <= 0 ? 0.0 : x; }, [](int64_t x) { return x > 0 ? x : 0; });
}
void neg(const ElementwiseCall& c) { generic_map<1>(c, [](double x, DTypeId) { return -x; }, std::negate<int64_t>{}); }
void exp(const ElementwiseCall& c) {
  auto f = [](double x, DTypeId d) {
    return DType::from_id(d).is_floating() ? std::exp(static_cast<float>(x)) : std::exp(x);  // a float's exp is Float32's
  };
  generic_map<1>(c, f, no_int);
}
// silu and sigmoid: Note [Stable sigmoid]'s formulas in double, rounded once.
void silu(const ElementwiseCall& c) { generic_map<1>(c, [](double x, DTypeId) { return silu_of(x); }, no_int); }
void sigmoid(const ElementwiseCall& c) { generic_map<1>(c, [](double x, DTypeId) { return sigmoid_of(x); }, no_int); }
void silu_backward(const ElementwiseCall& c) { generic_map<2>(c, silu_grad_of<double>, no_int); }
void sigmoid_backward(const ElementwiseCall& c) { generic_map<2>(c, sigmoid_grad_of<double>, no_int); }
}  // namespace generic

void generic_reduce_sum(const TensorImpl& in, const Layout& permuted, int64_t kept, bool, Carrier& out) {
  const int64_t n = permuted.size();
  const bool integer = !in.dtype().is_floating();
  std::vector<double> facc(static_cast<size_t>(kept), 0.0);
  std::vector<int64_t> iacc(static_cast<size_t>(kept), 0);
  for (int64_t i = 0; i < n; ++i) {
    Value v = in.carrier->read_value(in.offset + permuted.index(i));
    facc[i % kept] += as_double(v);
    iacc[i % kept] += as_int(v);
  }
  for (int64_t o = 0; o < kept; ++o) write_result(out, o, facc[o], iacc[o], integer, /*exact_sum=*/true);
}

void generic_matmul(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, bool f64,
                    Carrier& out) {
  const bool integer = out.dtype().id() == DTypeId::Int32;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double f = 0;
      int64_t r = 0;
      for (int64_t p = 0; p < k; ++p) {
        Value a = lhs.carrier->read_value(lhs.offset + lhs.layout.index(i + m * p));
        Value b = rhs.carrier->read_value(rhs.offset + rhs.layout.index(j + n * p));
        f += as_double(a) * as_double(b);
        int64_t t;
        if (integer && (__builtin_mul_overflow(as_int(a), as_int(b), &t) || __builtin_add_overflow(r, t, &r)))
          raise<OverflowError>("matmul: Int32 result overflows");
      }
      write_result(out, i + m * j, f, r, integer, /*exact_sum=*/true);
    }
  (void)f64;
}

}  // namespace sw::detail
