// strideweave/autograd.hpp — reverse-mode autograd: nodes and the engine.
//
// A node is recorded when grad mode is on, an input is differentiable and the
// result is differentiable. The result's `node` is that node; the node keeps
// its tensor operands (`inputs`, in order), the values it saves for backward
// (with their carrier versions at save time) and a weak reference to its
// output. `backward` traverses the graph in topological order, sums
// contributions per tensor, accumulates leaves into `.grad` (allocated with the
// leaf carrier's new_like) and keeps non-leaf grads only after retain_grad().
// Without retain_graph the traversed nodes are freed; using one again raises
// RuntimeError mentioning "retain_graph=True". Before a node's backward runs,
// every saved tensor's version is compared with the saved one ("modified
// in-place", naming the operation, the shape and both versions).
//
// Custom nodes (moves, projection, scatter) derive from Node and implement
// `apply`; the engine needs no change to run them.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "strideweave/tensor.hpp"

namespace sw {

struct SavedTensor {
  TensorPtr tensor;
  uint64_t version = 0;
};

// Note [Gradient sinks]: a node may offer a place where its output's gradient
// is *added* directly — dense column-major Float32 memory of the output's
// shape (`rows` x `cols`, a two-mode output). The projection of one resident
// tile offers its leaf's .grad tile when that gradient accumulates in place:
// the node producing the gradient (a matmul's VJP) then computes it into the
// tile with "C += ..." instead of writing a fresh tensor that the projection
// scatters and the leaf adds (two fewer passes over an expert's 4 MiB, per
// matrix and per step). The engine asks only when the consuming node is the
// output's last consumer and nothing else has contributed or retains it; a
// producer that cannot use the sink ignores it and returns the gradient as
// usual. After a producer has written into a sink (set `used`), the engine
// calls `commit` and passes no gradient to the offering node.
struct GradientSink {
  float* data = nullptr;
  int64_t rows = 0, cols = 0;
  // `data` holds the gradient row-major (its transpose, cols x rows, column-major): a tile of PyTorch's (out, in)
  // layout. A producer that cannot write that order ignores the sink.
  bool transposed = false;
  std::shared_ptr<void> keep_alive;  // the memory behind `data`
  std::function<void()> commit;      // after the write: dirty state, versions
  bool used = false;
};

struct Node : std::enable_shared_from_this<Node> {
  virtual ~Node() = default;
  std::string name;
  const CarrierKind* dispatch_kind = nullptr;
  std::vector<TensorPtr> inputs;     // tensor operands, in order
  std::vector<SavedTensor> saved;
  std::weak_ptr<TensorImpl> output;
  bool freed = false;

  // Records `t` for backward with its current version.
  void save(const TensorPtr& t) { saved.push_back({t, t->version()}); }
  // Gradients for `inputs` (nullptr where none flows), given the output's gradient.
  virtual std::vector<TensorPtr> apply(const TensorPtr& grad_output) = 0;
  // See Note [Gradient sinks]: where this node's output gradient may be added directly, or none.
  virtual std::optional<GradientSink> gradient_sink() { return std::nullopt; }
  // Drops what backward needed.
  virtual void release_saved() { saved.clear(); }
};

// Inside Node::apply, on the thread running backward: per input of that node,
// the sink its input's own node offers (Note [Gradient sinks]), or null;
// empty outside apply.
std::span<GradientSink* const> offered_sinks();

// Attaches `node` to `result` (sets result->node and node->output).
void attach_node(const std::shared_ptr<Node>& node, const TensorPtr& result);

void backward(const TensorPtr& root, const TensorPtr& gradient, bool retain_graph);

// Whether any operand tensor is differentiable (and grad mode is on).
bool should_record(std::span<const TensorPtr> inputs, const TensorPtr& result);

// Installs the autograd node hooks of lower layers (the move node). Idempotent.
void install_autograd_hooks();

}  // namespace sw
