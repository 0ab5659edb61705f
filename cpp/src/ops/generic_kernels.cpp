// The reference kernels of the Generic carrier: the simplest obviously-correct
// loops, one element at a time, in double (floats) or int64 (Int32). They are
// the oracle the fast kernels are tested against, not a fast path.
#include <cmath>
#include <limits>

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

void write_result(Carrier& out, int64_t i, double f, int64_t n, bool integer) {
  const DType& d = out.dtype();
  if (d.id() == DTypeId::Int32) {
    if (n < std::numeric_limits<int32_t>::min() || n > std::numeric_limits<int32_t>::max())
      raise<OverflowError>("Int32 result overflows");
    out.write_value(i, Value::from_int(n));
  } else if (d.id() == DTypeId::Bool) {
    out.write_value(i, Value::from_bool(integer ? n != 0 : f != 0.0));
  } else {
    out.write_value(i, Value::from_float(static_cast<double>(static_cast<float>(f))));
  }
}

}  // namespace

void generic_elementwise(OpId id, const std::vector<KernelInput>& in, const std::vector<int64_t>& ext, Carrier& out) {
  int64_t n = 1;
  for (auto e : ext) n *= e;
  const bool integer = out.dtype().id() != DTypeId::Float32;
  for (int64_t i = 0; i < n; ++i) {
    Value a = element(in[0], ext, i);
    double fa = as_double(a), f = 0;
    int64_t ia = as_int(a), r = 0;
    if (in.size() == 2) {
      Value b = element(in[1], ext, i);
      double fb = as_double(b);
      int64_t ib = as_int(b);
      switch (id) {
        case OpId::Add: f = fa + fb; r = ia + ib; break;
        case OpId::Sub: f = fa - fb; r = ia - ib; break;
        case OpId::Mul:
        case OpId::ElementwiseMul: f = fa * fb; r = ia * ib; break;
        case OpId::Div: f = fa / fb; break;
        default: SW_ASSERT(false, "not a binary op");
      }
    } else {
      switch (id) {
        case OpId::Relu: f = fa > 0 ? fa : 0; r = ia > 0 ? ia : 0; break;
        case OpId::Neg: f = -fa; r = -ia; break;
        case OpId::Exp: f = in[0].dtype == DTypeId::Float32 ? std::exp(static_cast<float>(fa)) : std::exp(fa); break;
        default: SW_ASSERT(false, "not a unary op");
      }
    }
    write_result(out, i, f, r, integer);
  }
}

void generic_reduce_sum(const TensorImpl& in, const Layout& permuted, int64_t kept, bool, Carrier& out) {
  const int64_t n = permuted.size();
  const bool integer = in.dtype().id() != DTypeId::Float32;
  std::vector<double> facc(static_cast<size_t>(kept), 0.0);
  std::vector<int64_t> iacc(static_cast<size_t>(kept), 0);
  for (int64_t i = 0; i < n; ++i) {
    Value v = in.carrier->read_value(in.offset + permuted.index(i));
    facc[i % kept] += as_double(v);
    iacc[i % kept] += as_int(v);
  }
  for (int64_t o = 0; o < kept; ++o) write_result(out, o, facc[o], iacc[o], integer);
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
      write_result(out, i + m * j, f, r, integer);
    }
  (void)f64;
}

}  // namespace sw::detail
