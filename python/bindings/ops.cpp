// Operations, autograd and grad mode.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include "common.hpp"
#include "completion_py.hpp"
#include "extension.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"

namespace swpy {

namespace {

using sw::Operand;
using sw::OpId;
using sw::TensorPtr;

Operand operand(nb::handle h, const char* op, bool allow_scalar) {
  if (nb::isinstance<sw::TensorImpl>(h)) return Operand::of(nb::cast<TensorPtr>(h));
  if (nb::isinstance<AwaitHandle>(h))
    sw::raise<sw::TypeError>(op, ": operand is a pending ", nb::cast<std::string>(h.type().attr("__name__")),
                             ", not a Tensor; call wait() first");
  if (allow_scalar && !PyBool_Check(h.ptr()) && (PyLong_Check(h.ptr()) || PyFloat_Check(h.ptr())))
    return Operand::weak(to_value(h));
  sw::raise<sw::TypeError>(op, ": operands must be Tensors", allow_scalar ? " or Python numbers" : "", ", got ",
                           nb::cast<std::string>(h.type().attr("__name__")));
}

// Note [Blocking without the GIL]. An operand on a dependent carrier (a TiledEvictable) is made
// available inside call_op, which waits for transfers and gathers on the library's pools; backward
// may do the same for saved tiled inputs. Those pool tasks may need the GIL (a Python-owned
// reference they drop, a policy or provider callback), so waiting with it held can deadlock, and
// would in any case freeze every other Python thread for the whole transfer. Dense operands never
// block: they keep the GIL (no release/acquire on the fast path).
TensorPtr run_op(OpId id, std::span<const Operand> ops, const sw::OpOptions& o = {}) {
  bool may_block = false;
  for (const auto& op : ops) may_block |= op.is_tensor() && op.tensor->carrier->kind().dependent;
  if (!may_block) return sw::call_op(id, ops, o);
  GilRelease nogil;
  return sw::call_op(id, ops, o);
}

bool f64_option(nb::handle acc) {
  if (acc.is_none()) return false;
  if (!nb::isinstance<sw::DType>(acc)) sw::raise<sw::TypeError>("accumulator_dtype must be None or DType.Float64");
  if (&nb::cast<const sw::DType&>(acc) != &sw::DType::Float64())
    sw::raise<sw::ValueError>("accumulator_dtype must be None or DType.Float64, got ",
                              nb::cast<const sw::DType&>(acc).name());
  return true;
}

std::optional<std::string> description_of(nb::handle d) {
  if (d.is_none()) return std::nullopt;
  if (!PyUnicode_Check(d.ptr())) sw::raise<sw::TypeError>("reduce_sum description must be a str like 'a b -> a'");
  return nb::cast<std::string>(d);
}

TensorPtr binary(OpId id, nb::handle a, nb::handle b) {
  bool scalars = sw::op_def(id).weak_scalars;
  Operand ops[2] = {operand(a, sw::op_def(id).name, scalars), operand(b, sw::op_def(id).name, scalars)};
  return run_op(id, ops);
}

TensorPtr unary(OpId id, nb::handle a) {
  Operand ops[1] = {operand(a, sw::op_def(id).name, false)};
  return run_op(id, ops);
}

// An operation with options: one operand and a description (reduce_sum), or two operands (matmul); the
// accumulator dtype where the row takes one.
TensorPtr with_options(OpId id, nb::handle a, nb::handle b, nb::handle description, nb::handle acc) {
  const sw::OpDef& d = sw::op_def(id);
  Operand ops[2];
  for (int i = 0; i < d.arity; ++i) ops[i] = operand(i == 0 ? a : b, d.name, d.weak_scalars);
  sw::OpOptions o;
  if (d.takes_description()) o.description = description_of(description);
  if (d.takes_accumulator()) o.accumulate_f64 = f64_option(acc);
  return run_op(id, std::span<const Operand>(ops, static_cast<size_t>(d.arity)), o);
}

TensorPtr matmul(nb::handle a, nb::handle b, nb::handle acc) { return with_options(OpId::Matmul, a, b, {}, acc); }

// The Python type of an operand: a Tensor, or also a number where the row takes weak scalars.
std::string operand_type(const sw::OpDef& d) {
  return d.weak_scalars ? "strideweave._core.Tensor | int | float" : "strideweave._core.Tensor";
}

// The typed signature of an operation's module function, for help() and the .pyi stubs.
std::string signature_of(const sw::OpDef& d) {
  std::string s = std::string("def ") + d.name + "(";
  for (int i = 0; i < d.arity; ++i) s += std::string(i ? ", " : "") + d.operand_names[i] + ": " + operand_type(d);
  if (d.takes_description()) s += ", description: str | None = None";
  if (d.takes_accumulator()) s += ", *, accumulator_dtype: strideweave._core.DType | None = None";
  return s + ") -> strideweave._core.Tensor";
}

// row operations (Note [Row operations] in cpp/src/ops/rows.cpp): sw.softmax(t, mode), sw.topk(t, k, mode) ->
// (values, indices), sw.index_select(t, mode, indices), sw.index_add(t, mode, indices, source).
int64_t int_argument(nb::handle h, const char* op, const char* what) {
  if (PyBool_Check(h.ptr()) || !PyLong_Check(h.ptr()))
    sw::raise<sw::TypeError>(op, ": ", what, " must be an int, got ", nb::cast<std::string>(h.type().attr("__name__")));
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
  if (overflow) sw::raise<sw::ValueError>(op, ": ", what, " is out of range");
  return static_cast<int64_t>(v);
}

// Runs a row operation from Python arguments in the function's order: (t, k, mode) for topk, (t, mode, ...) for
// the others; a tuple (values, indices) for topk, else the result.
nb::object run_row_op(OpId id, std::span<const nb::handle> args) {
  const sw::OpDef& d = sw::op_def(id);
  sw::OpOptions o;
  std::vector<Operand> ops{operand(args[0], d.name, false)};
  size_t next = 1;
  if (d.takes_k()) o.k = int_argument(args[next++], d.name, "k");
  o.mode = int_argument(args[next++], d.name, "mode");
  for (; next < args.size(); ++next) ops.push_back(operand(args[next], d.name, false));
  if (d.results() == 1) return nb::cast(run_op(id, ops, o));
  TensorPtr second;
  o.second = &second;
  TensorPtr first = run_op(id, ops, o);
  return nb::make_tuple(first, second);
}

// The Python parameters of a row operation in order, and its signature.
std::vector<const char*> row_parameters(const sw::OpDef& d) {
  std::vector<const char*> p{d.operand_names[0]};
  if (d.takes_k()) p.push_back("k");
  p.push_back("mode");
  for (int i = 1; i < d.arity; ++i) p.push_back(d.operand_names[i]);
  return p;
}

size_t row_arity(const sw::OpDef& d) { return row_parameters(d).size(); }

void bind_row_op(nb::module_& m, const sw::OpDef& d) {
  const OpId id = d.id;
  std::string sig = std::string("def ") + d.name + "(";
  const auto params = row_parameters(d);
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string p = params[i];
    sig += std::string(i ? ", " : "") + p + ": " + (p == "k" || p == "mode" ? "int" : "strideweave._core.Tensor");
  }
  sig += d.results() == 2 ? ") -> tuple[strideweave._core.Tensor, strideweave._core.Tensor]" : ") -> strideweave._core.Tensor";
  if (params.size() == 2)
    m.def(d.name, [id](nb::handle a, nb::handle b) { const nb::handle h[] = {a, b}; return run_row_op(id, h); },
          nb::arg(params[0]), nb::arg(params[1]), nb::sig(sig.c_str()));
  else if (params.size() == 3)
    m.def(d.name, [id](nb::handle a, nb::handle b, nb::handle c) { const nb::handle h[] = {a, b, c}; return run_row_op(id, h); },
          nb::arg(params[0]), nb::arg(params[1]), nb::arg(params[2]), nb::sig(sig.c_str()));
  else
    m.def(d.name,
          [id](nb::handle a, nb::handle b, nb::handle c, nb::handle e) {
            const nb::handle h[] = {a, b, c, e};
            return run_row_op(id, h);
          },
          nb::arg(params[0]), nb::arg(params[1]), nb::arg(params[2]), nb::arg(params[3]), nb::sig(sig.c_str()));
}

// Binds one row of the operation table as a module function: sw.<name>(operands..., options...).
void bind_op(nb::module_& m, const sw::OpDef& d) {
  const OpId id = d.id;
  if (d.takes_mode()) return bind_row_op(m, d);  // row operations
  const std::string sig = signature_of(d);
  if (!d.takes_description() && !d.takes_accumulator()) {
    if (d.arity == 1)
      m.def(d.name, [id](nb::handle t) { return unary(id, t); }, nb::arg(d.operand_names[0]), nb::sig(sig.c_str()));
    else
      m.def(d.name, [id](nb::handle a, nb::handle b) { return binary(id, a, b); }, nb::arg(d.operand_names[0]),
            nb::arg(d.operand_names[1]), nb::sig(sig.c_str()));
  } else if (d.arity == 1 && d.takes_description() && d.takes_accumulator()) {
    m.def(d.name,
          [id](nb::handle t, nb::handle description, nb::handle acc) { return with_options(id, t, {}, description, acc); },
          nb::arg(d.operand_names[0]), nb::arg("description") = nb::none(), nb::kw_only(),
          nb::arg("accumulator_dtype") = nb::none(), nb::sig(sig.c_str()));
  } else if (d.arity == 2 && !d.takes_description() && d.takes_accumulator()) {
    m.def(d.name, [id](nb::handle a, nb::handle b, nb::handle acc) { return with_options(id, a, b, {}, acc); },
          nb::arg(d.operand_names[0]), nb::arg(d.operand_names[1]), nb::kw_only(),
          nb::arg("accumulator_dtype") = nb::none(), nb::sig(sig.c_str()));
  } else {
    sw::raise<sw::RuntimeError>("bind_op: no binding for the operands and options of '", d.name, "'");
  }
}

// The object returned by dispatch_op(name).
struct Operation {
  OpId id;
  sw::CarrierPtr carrier;
};

nb::object kind_class(const sw::CarrierKind* kind) { return class_of_kind(kind); }

void check_grad_capable(const sw::TensorImpl& t, const char* what) {
  if (!t.is_differentiable())
    sw::raise<sw::RuntimeError>(what, ": a ", t.dtype().name(), " tensor is not differentiable");
}

}  // namespace

void bind_ops(nb::module_& m) {
  sw::install_autograd_hooks();
  for (const sw::OpDef& d : sw::op_table()) bind_op(m, d);

  m.def("is_grad_enabled", &sw::is_grad_enabled);
  m.def("set_grad_enabled", [](nb::handle flag) {
    if (!PyBool_Check(flag.ptr())) sw::raise<sw::TypeError>("set_grad_enabled takes a bool");
    sw::set_grad_enabled(flag.ptr() == Py_True);
  }, nb::arg("flag"));

  nb::class_<sw::Node>(m, "Node", "An autograd node: the operation that produced a tensor.")
      .def("inputs", [](const sw::Node& n) {
        nb::list out;
        for (const auto& t : n.inputs) out.append(nb::cast(t));
        return nb::tuple(out);
      })
      .def_prop_ro("name", [](const sw::Node& n) { return n.name; })
      .def_prop_ro("_operation_name", [](const sw::Node& n) { return n.name; })
      .def_prop_ro("dispatch_carrier_class", [](const sw::Node& n) { return kind_class(n.dispatch_kind); })
      .def_prop_ro("_dispatch_carrier_class", [](const sw::Node& n) { return kind_class(n.dispatch_kind); })
      .def("__repr__", [](const sw::Node& n) { return "<autograd node " + n.name + ">"; });

  nb::class_<Operation>(m, "Operation", "An operation dispatched by a carrier: forward(*operands).")
      .def_prop_ro("name", [](const Operation& o) { return std::string(sw::op_def(o.id).name); })
      .def_prop_ro("_operation_name", [](const Operation& o) { return std::string(sw::op_def(o.id).name); })
      .def_prop_ro("dispatch_carrier_class", [](const Operation& o) { return kind_class(&o.carrier->kind()); })
      .def_prop_ro("_dispatch_carrier_class", [](const Operation& o) { return kind_class(&o.carrier->kind()); })
      .def("forward", [](const Operation& o, nb::args args, nb::kwargs kw) -> nb::object {
        // Mirrors the module function: forward(*args, **kwargs) == sw.<name>(*args, **kwargs).
        const sw::OpDef& d = sw::op_def(o.id);
        if (d.takes_mode()) {  // row operations: positional arguments in the function's order
          if (kw.size() != 0) sw::raise<sw::TypeError>(d.name, ".forward() takes positional arguments only");
          if (args.size() != row_arity(d))
            sw::raise<sw::TypeError>(d.name, ".forward() takes ", row_arity(d), " arguments, got ", args.size());
          std::vector<nb::handle> h;
          for (size_t i = 0; i < args.size(); ++i) h.push_back(args[i]);
          for (nb::handle x : h)
            if (nb::isinstance<sw::TensorImpl>(x) && &nb::cast<const sw::TensorImpl&>(x).carrier->kind() != &o.carrier->kind())
              sw::raise<sw::TypeError>(d.name, ": Tensor backing carriers must match (dispatching ", o.carrier->kind_name(),
                                       ", operand ", nb::cast<const sw::TensorImpl&>(x).carrier->kind_name(), ")");
          return run_row_op(o.id, h);
        }
        const bool has_description = d.takes_description();
        const bool has_accumulator = d.takes_accumulator();
        nb::handle acc = nb::none(), desc = nb::none();
        for (auto [key, value] : kw) {
          std::string k = nb::cast<std::string>(key);
          if (has_accumulator && k == "accumulator_dtype") acc = value;
          else if (has_description && k == "description") desc = value;
          else sw::raise<sw::TypeError>(d.name, ".forward() got an unexpected keyword argument '", k, "'");
        }
        size_t n = args.size();
        // reduce_sum(t, description): the description is not an operand.
        if (has_description && n == static_cast<size_t>(d.arity) + 1) {
          if (kw.contains("description"))
            sw::raise<sw::TypeError>(d.name, ".forward() got multiple values for argument 'description'");
          desc = args[1];
          n = 1;
        }
        if (static_cast<int>(n) > d.arity)
          sw::raise<sw::TypeError>(d.name, " takes ", d.arity, " operand", d.arity == 1 ? "" : "s", ", got ", n);
        std::vector<Operand> ops;
        for (size_t i = 0; i < n; ++i) ops.push_back(operand(args[i], d.name, d.weak_scalars));
        sw::OpOptions opts;
        if (has_description) opts.description = description_of(desc);
        opts.accumulate_f64 = f64_option(acc);
        for (const auto& op : ops)
          if (op.is_tensor() && &op.tensor->carrier->kind() != &o.carrier->kind())
            sw::raise<sw::TypeError>(d.name, ": Tensor backing carriers must match (dispatching ",
                                     o.carrier->kind_name(), ", operand ", op.tensor->carrier->kind_name(), ")");
        return nb::cast(run_op(o.id, ops, opts));
      },
      // a Tensor; (values, indices) for topk (row operations)
      nb::sig("def forward(self, *args: typing.Any, **kwargs: typing.Any) -> typing.Any"));

  nb::handle carrier = nb::type<sw::Carrier>();
  carrier.attr("dispatch_op") = nb::cpp_function(
      [](nb::handle self, nb::handle name) {
        auto c = nb::cast<sw::CarrierPtr>(self);
        c->check_live("dispatch an operation");  // before the name: after release, dispatch fails whatever it is
        if (!PyUnicode_Check(name.ptr())) sw::raise<sw::TypeError>("dispatch_op: name must be a str");
        std::string n = nb::cast<std::string>(name);
        auto id = sw::op_from_name(n);
        if (!id) sw::raise<sw::NotImplementedError>(c->kind_name(), " has no operation named '", n, "'");
        sw::OpBackend* b = sw::backend_for(c->kind());
        if (!b || !b->executes(*c, *id))
          sw::raise<sw::NotImplementedError>(c->kind_name(), " does not execute '", n, "'");
        return nb::cast(Operation{*id, c});
      },
      nb::is_method(), nb::arg("name"));
  carrier.attr("operation_capabilities") = nb::cpp_function(
      [](nb::handle self, nb::handle name) {
        const sw::Carrier& c = nb::cast<const sw::Carrier&>(self);
        std::optional<OpId> only;
        if (!name.is_none()) {
          if (!PyUnicode_Check(name.ptr())) sw::raise<sw::TypeError>("operation_capabilities: name must be a str");
          only = sw::op_from_name(nb::cast<std::string>(name));
          if (!only) return nb::tuple();
        }
        nb::module_ caps = nb::module_::import_("strideweave._capabilities");
        nb::list out;
        for (const auto& cap : sw::operation_capabilities(c, only)) {
          nb::list operands;
          for (const auto& o : cap.operands)
            operands.append(caps.attr("_operand")(o.weak_scalar ? "weak_scalar" : "tensor",
                                                  nb::cast(o.dtype, nb::rv_policy::reference)));
          out.append(caps.attr("OperationCapability")(sw::op_def(cap.op).name, nb::tuple(operands)));
        }
        return nb::tuple(out);
      },
      nb::is_method(), nb::arg("name") = nb::none());

  nb::handle tensor = nb::type<sw::TensorImpl>();
  tensor.attr("autograd_ctx") = nb::steal(PyObject_CallFunctionObjArgs(
      (PyObject*)&PyProperty_Type,
      nb::cpp_function([](const sw::TensorImpl& t) {
        std::lock_guard lock(t.mutex);
        return t.node;
      }).ptr(),
      nullptr));
  tensor.attr("backward") = nb::cpp_function(
      [](nb::handle self, nb::handle gradient, bool retain_graph) {
        TensorPtr t = nb::cast<TensorPtr>(self);
        check_grad_capable(*t, "backward");
        TensorPtr g;
        if (!gradient.is_none()) {
          if (!nb::isinstance<sw::TensorImpl>(gradient)) sw::raise<sw::TypeError>("backward: gradient must be a Tensor");
          g = nb::cast<TensorPtr>(gradient);
        }
        GilRelease nogil;  // Note [Blocking without the GIL]
        sw::backward(t, g, retain_graph);
      },
      nb::is_method(), nb::arg("gradient") = nb::none(), nb::arg("retain_graph") = false);
  tensor.attr("retain_grad") = nb::cpp_function(
      [](sw::TensorImpl& t) {
        check_grad_capable(t, "retain_grad");
        std::lock_guard lock(t.mutex);
        t.retains_grad = true;
      },
      nb::is_method());
}

}  // namespace swpy

namespace swpy {

void bind_tensor_operators(nb::module_& m) {
  nb::handle tensor = nb::type<sw::TensorImpl>();
  // Operators with typed signatures: the operand type is the row's (a number too where it takes weak scalars).
  auto op2 = [&](const char* name, OpId id, bool reflected) {
    const std::string sig = std::string("def ") + name + "(self, other: " + operand_type(sw::op_def(id)) +
                            ") -> strideweave._core.Tensor";
    tensor.attr(name) = nb::cpp_function(
        [id, reflected](nb::handle self, nb::handle other) {
          return reflected ? binary(id, other, self) : binary(id, self, other);
        },
        nb::is_method(), nb::arg("other"), nb::sig(sig.c_str()));
  };
  op2("__add__", OpId::Add, false);
  op2("__mul__", OpId::Mul, false);
  op2("__rmul__", OpId::Mul, true);
  op2("__sub__", OpId::Sub, false);
  op2("__truediv__", OpId::Div, false);
  // a Python number on the left: 1 + t, 1 - t, 1 / t (weak scalars; docs/guide.md, "Activations and scalars on
  // either side")
  op2("__radd__", OpId::Add, true);
  op2("__rsub__", OpId::Sub, true);
  op2("__rtruediv__", OpId::Div, true);
  tensor.attr("__matmul__") = nb::cpp_function(
      [](nb::handle self, nb::handle other) { return matmul(self, other, nb::none()); }, nb::is_method(),
      nb::arg("other"), nb::sig("def __matmul__(self, other: strideweave._core.Tensor) -> strideweave._core.Tensor"));
  tensor.attr("__neg__") = nb::cpp_function([](nb::handle self) { return unary(OpId::Neg, self); }, nb::is_method(),
                                            nb::sig("def __neg__(self) -> strideweave._core.Tensor"));
}

}  // namespace swpy
