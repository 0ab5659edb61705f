// The operation backend of TiledEvictable (direct operations on full tiled tensors: materialise, compute densely,
// record one node), with the tiled gradient rules (Note [Tiled gradient accumulation], data.hpp).
#include <functional>

#include "strideweave/autograd.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "tile_copies.hpp"

namespace sw {

namespace {

TileSelection full_selection(const TiledEvictable& c) {
  TileSelection sel;
  for (int64_t g : c.grid_shape()) {
    std::vector<int64_t> axis(static_cast<size_t>(g));
    for (int64_t i = 0; i < g; ++i) axis[static_cast<size_t>(i)] = i;
    sel.per_axis.push_back(std::move(axis));
  }
  return sel;
}

// The full logical tensor as a dense compute-carrier tensor (blocking).
TensorPtr materialize(const TensorPtr& t, const char* purpose) {
  auto c = std::static_pointer_cast<TiledEvictable>(t->carrier);
  GradModeGuard off(false);
  TensorPtr dense = project_for(c, t, full_selection(*c), nullptr, purpose)->value();
  // Keep the caller's hierarchy (nested modes) over the dense values, in the compact tensor's mode order (a
  // row-major tensor's projection is row-major: Note [Within-tile layouts] in tile_copies.hpp): mode k's leaves
  // step through its ordinals, each ordinal `mode_stride[k]` slots apart.
  const std::vector<int64_t> mode_stride = *mode_strides(dense->layout);
  std::function<IntTuple(const IntTuple&, int64_t&)> strides_of = [&](const IntTuple& node, int64_t& step) {
    if (node.is_leaf()) {
      IntTuple leaf(step);
      step *= node.value();
      return leaf;
    }
    std::vector<IntTuple> children;
    for (const IntTuple& child : node.children()) children.push_back(strides_of(child, step));
    return IntTuple::tuple(std::move(children));
  };
  std::vector<IntTuple> modes;
  for (size_t k = 0; k < t->layout.rank(); ++k) {
    int64_t step = mode_stride[k];
    modes.push_back(strides_of(t->layout.shape().tree()[k], step));
  }
  return make_tensor(dense->carrier, 0, Layout(t->layout.shape(), Stride(IntTuple::tuple(std::move(modes)))));
}

class TiledBackend final : public OpBackend {
 public:
  // The central operations, and the row operations (Note [Row operations] in cpp/src/ops/rows.cpp), on the
  // materialised tensors like the central ones.
  bool supports(OpId id) const override { return op_def(id).central || op_def(id).takes_mode(); }
  bool materializes() const override { return true; }
  TensorPtr materialize_for_backward(const TensorPtr& input) override { return materialize(input, "backward"); }
  TensorPtr gradient_from_dense(const TensorPtr& input, const TensorPtr& dense_in) override {
    auto c = std::static_pointer_cast<TiledEvictable>(input->carrier);
    TensorPtr dense = dense_in;
    if (auto g = std::dynamic_pointer_cast<TiledEvictable>(dense->carrier)) {
      // A tiled gradient in another dtype (a Float32 sum for a 16-bit leaf: Note [Tiled gradients of 16-bit
      // parameters]) converts tile by tile when it is laid out like the input; otherwise it is read densely.
      if (g->geometry() == c->geometry() && dense->offset == input->offset && dense->layout == input->layout)
        return convert_tiled_gradient(dense, c->dtype());
      dense = materialize(dense, "backward");
    }
    TileSelection sel = full_selection(*c);
    TensorPtr flat = make_tensor(dense->carrier, dense->offset, column_major(Shape::flat(c->logical_shape())));
    if (!dense->layout.is_column_major() || dense->offset != 0) flat = expand_dense(dense, dense->layout.shape());
    TensorPtr g = scatter_add_gradient(c, input, sel, make_tensor(flat->carrier, 0, column_major(Shape::flat(c->logical_shape()))));
    return convert_tiled_gradient(g, c->dtype());  // the leaf's dtype, rounded once (g itself when it has it)
  }
  TensorPtr forward(OpId id, std::span<const Operand> ops, const OpOptions& options) override {
    std::vector<Operand> dense;
    for (const auto& o : ops) dense.push_back(o.is_tensor() ? Operand::of(materialize(o.tensor, "operation")) : o);
    GradModeGuard off(false);  // one outer node: the caller records it
    return call_op(id, dense, options);
  }
  // Tiled gradients of one geometry and layout add tile by tile (no dense temporary); others: the engine's rule.
  TensorPtr add_gradients(const TensorPtr& a, const TensorPtr& b) override {
    return tiled_gradients_compatible(a, b) ? add_tiled_gradients(a, b) : nullptr;
  }
  // A tiled .grad that only its leaf holds (no Python reference, no saved copy: the tensor is referenced by the
  // leaf's .grad and the engine's `current`, its carrier by the tensor alone, apart from its own residency
  // requests) accumulates in place, tile by tile: the cost is the tiles `g` touches, not the full extent. See
  // Note [Tiled gradient accumulation].
  bool accumulate_in_place(const TensorPtr& current, const TensorPtr& g, bool owned) override {
    if (!tiled_gradients_compatible(current, g) || current.use_count() != 2 || !current->carrier->is_mutable() ||
        current->carrier->is_owned())
      return false;
    auto& acc = static_cast<TiledEvictable&>(*current->carrier);
    const bool share = owned && g->carrier.use_count() == 1;  // g's tile buffers die with g
    // Residency requests of other tiles may be under way (Note [Requests' own references]); accumulate_tiles
    // refuses a tile that one is transitioning.
    return TiledInternals::only_reference_is(acc, current->carrier) &&
           TiledInternals::accumulate_tiles(acc, static_cast<TiledEvictable&>(*g->carrier), share);
  }
};

}  // namespace

void install_tiled_backend() {
  static const bool done = [] {
    register_backend(&tiled_evictable_kind(), std::make_shared<TiledBackend>());
    return true;
  }();
  (void)done;
}

}  // namespace sw
