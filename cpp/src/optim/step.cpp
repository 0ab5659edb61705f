// Optimizer::step (Note [Optimizers on tiled parameters] in strideweave/optim.hpp): the gradients checked first,
// then each parameter tile by tile: the tile's weight, gradient and state made resident (promotions under the
// weight's budget) and held, the next tile's transfers started, one update pass, the weight and state committed
// (dirty, version advanced) and every hold ended, so the budget may evict them afterwards.
#include <algorithm>
#include <cmath>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/optim.hpp"
#include "../tiled/internal.hpp"
#include "optim_internal.hpp"

namespace sw::optim {

namespace {

using Hold = std::unique_ptr<TiledInternals::TileWrite>;

// Tile `i` of `c` resident (promoted through the residency path: admitted under a budget; an implicit tile becomes
// a zero buffer) and held for an in-place update. Other work on the tile is waited for in turn (Note [Taking
// turns] in cpp/src/tiled/residency.cpp): a loop evicting or promoting the same tiles cannot starve the step, nor
// the step the loop. RuntimeError after the wait limit, or when the tile's primary tier has no host memory.
Hold hold_resident(TiledEvictable& c, int64_t i, const char* what, const char* name) {
  const std::string label = std::string(name) + ".step (the " + what + ")";
  if (Hold h = TiledInternals::hold_in_turn(c, i, label.c_str())) return h;
  raise<RuntimeError>(name, ".step: tile ", coord_str(c.tile_coord(i)), " of the ", what,
                      " could not be held for its update: its primary tier has no host memory");
}

}  // namespace

void Optimizer::step() {
  std::lock_guard lock(mutex_);
  const char* name = algorithm_name(algorithm_);
  // The gradients, every one checked before any tile changes.
  std::vector<TensorPtr> grads(slots_.size());
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Slot& s = *slots_[k];
    TensorPtr g;
    {
      std::lock_guard glock(s.param->mutex);
      g = s.param->grad;
    }
    if (!g) continue;
    if (!detail::float_dtype(g->dtype()))
      raise<TypeError>(name, ".step: the gradient of parameter ", k, " has dtype ", g->dtype().name(),
                       "; gradients are Float32, BFloat16 or Float16");
    if (!(g->layout == s.param->layout))
      raise<ValueError>(name, ".step: the gradient of parameter ", k, " has layout ", g->layout.str(),
                        ", its parameter ", s.param->layout.str(), "; a gradient must have its parameter's layout");
    if (g->carrier == s.param->carrier || g->carrier->is_released())
      raise<ValueError>(name, ".step: the gradient of parameter ", k, " is ",
                        g->carrier->is_released() ? "over a released carrier" : "the parameter's own carrier");
    if (s.tiled) {
      auto gt = std::dynamic_pointer_cast<TiledEvictable>(g->carrier);
      if (!gt || !(gt->geometry() == s.tiled->geometry()) || g->offset != s.param->offset)
        raise<ValueError>(name, ".step: the gradient of parameter ", k, " (a TiledEvictable of grid ",
                          coord_str(s.tiled->grid_shape()), " and tile ", coord_str(s.tiled->tile_shape()),
                          ") must be a tiled gradient of that geometry from offset ", s.param->offset, ", got ",
                          gt ? "a TiledEvictable of grid " + coord_str(gt->grid_shape()) + " and tile " +
                                   coord_str(gt->tile_shape()) + " from offset " + std::to_string(g->offset)
                             : "a " + g->carrier->kind().name + " carrier");
      if (const auto& budget = s.tiled->residency_budget()) {
        const int64_t n = s.tiled->tile_size();
        const bool state1 = s.state1 && uses_state1();
        const int64_t sb = state_bytes(n);
        const int64_t need = s.tiled->tile_bytes() + gt->tile_bytes() + (state1 ? sb : 0) + (s.state2 ? sb : 0);
        if (need > budget->max_bytes())
          raise<ValueError>(name, ".step: one tile of parameter ", k, " with its gradient and state takes ", need,
                            " bytes, more than its ResidencyBudget's max_bytes ", budget->max_bytes(),
                            "; a step holds them resident together");
      }
    } else if (&g->carrier->kind() != &cpu_kind() || !g->carrier->native_data()) {
      raise<ValueError>(name, ".step: the gradient of dense parameter ", k, " is over a ", g->carrier->kind().name,
                        " carrier; it must be dense CPU memory");
    }
    grads[k] = std::move(g);
  }
  counts_.steps++;
  for (size_t k = 0; k < slots_.size(); ++k) {
    Slot& s = *slots_[k];
    // Tiles stepped in backward in this step are neither stepped again nor skipped (their gradient is gone); the
    // step ends here for them (Note [Stepping in backward]).
    const auto in_backward = std::count(s.stepped_in_backward.begin(), s.stepped_in_backward.end(), uint8_t{1});
    std::fill(s.stepped_in_backward.begin(), s.stepped_in_backward.end(), 0);
    counts_.tiles_skipped -= in_backward;
    if (!grads[k]) {
      counts_.tiles_skipped += static_cast<int64_t>(s.steps.size());
      continue;
    }
    step_slot(s, grads[k]);
  }
}

void Optimizer::step_slot(Slot& s, const TensorPtr& grad) {
  const char* name = algorithm_name(algorithm_);
  const DTypeId gd = grad->dtype().id();
  // SGD with momentum 0 neither reads nor writes its buffers (kept from a step with momentum, as torch keeps them).
  const TensorPtr state1 = uses_state1() ? s.state1 : nullptr;
  if (!s.tiled) {  // a dense parameter: one tile, its memory updated in place
    // The step runs without the GIL: each carrier it reads or writes is claimed for the update, so another
    // thread's release() raises "... owned by <name>.step (wait for it)" instead of freeing the memory under it
    // (a carrier already released is refused here, naming it, before anything changes).
    const std::string owner = std::string(name) + ".step";
    std::vector<Carrier::Claim> claims;
    claims.push_back(s.param->carrier->claim(owner));
    claims.push_back(grad->carrier->claim(owner));
    if (state1) claims.push_back(state1->carrier->claim(owner));
    if (s.state2) claims.push_back(s.state2->carrier->claim(owner));
    auto* w = s.param->carrier->mutable_native_data() + s.param->offset * static_cast<int64_t>(slot_bytes(s.param->dtype()));
    const auto* g = grad->carrier->native_data() + grad->offset * static_cast<int64_t>(slot_bytes(grad->dtype()));
    void* s1 = state1 ? state1->carrier->mutable_native_data() : nullptr;
    void* s2 = s.state2 ? s.state2->carrier->mutable_native_data() : nullptr;
    update_tile(s, 0, w, g, gd, s1, s2);
    s.param->carrier->bump_version();
    if (state1) state1->carrier->bump_version();
    if (s.state2) s.state2->carrier->bump_version();
    return;
  }
  TiledEvictable& W = *s.tiled;
  auto G = std::static_pointer_cast<TiledEvictable>(grad->carrier);
  TiledEvictable* S1 = state1 ? static_cast<TiledEvictable*>(state1->carrier.get()) : nullptr;
  TiledEvictable* S2 = s.state2 ? static_cast<TiledEvictable*>(s.state2->carrier.get()) : nullptr;
  const TiledStats w0 = W.stats(), g0 = G->stats();
  // The tiles with a gradient, in canonical order; an implicit gradient tile is skipped (torch: .grad is None).
  std::vector<int64_t> tiles;
  for (const TileCoord& t : G->tiles_where([](const TileState& st) { return st.location != TileLocation::Implicit; }))
    tiles.push_back(G->tile_index(t));
  std::sort(tiles.begin(), tiles.end());
  counts_.tiles_skipped += W.tile_count() - static_cast<int64_t>(tiles.size());
  std::vector<TiledEvictable*> carriers = {&W, G.get()};
  if (S1) carriers.push_back(S1);
  if (S2) carriers.push_back(S2);
  std::vector<CompletionPtr<std::monostate>> prefetch;
  for (size_t k = 0; k < tiles.size(); ++k) {
    const int64_t i = tiles[k];
    for (auto& p : prefetch) p->wait();  // its errors, if any, come back from the promotions below
    prefetch.clear();
    Hold hw = hold_resident(W, i, "weight", name);
    Hold hg = hold_resident(*G, i, "gradient", name);
    Hold h1 = S1 ? hold_resident(*S1, i, "optimizer state", name) : nullptr;
    Hold h2 = S2 ? hold_resident(*S2, i, "optimizer state", name) : nullptr;
    // The next tile's transfers run on the I/O pool during this update, when the budget has room for them
    // besides the tiles held here (else they are left to the next iteration).
    if (prefetch_ && k + 1 < tiles.size()) {
      const int64_t j = tiles[k + 1];
      const TileCoord next = W.tile_coord(j);
      for (TiledEvictable* c : carriers) {
        if (c->tile_state(next).location != TileLocation::Secondary) continue;
        try {
          prefetch.push_back(c->promote_async({j}));
          counts_.prefetches++;
        } catch (const Error&) {  // no room now: the next iteration promotes it itself
        }
      }
    }
    update_tile(s, i, hw->data(), hg->data(), gd, h1 ? h1->data() : nullptr, h2 ? h2->data() : nullptr);
    hw->commit();
    if (h1) h1->commit();
    if (h2) h2->commit();
    hg.reset();  // read only: the hold ends, the gradient tile unchanged
  }
  for (auto& p : prefetch) p->wait();
  detail::add_traffic(counts_.weights, w0, W.stats());
  detail::add_traffic(counts_.gradients, g0, G->stats());
}

void Optimizer::update_tile(Slot& s, int64_t i, void* w, const void* g, DTypeId gd, void* s1, void* s2) {
  const int64_t step = ++s.steps[static_cast<size_t>(i)];
  const bool first = !s.stateful[static_cast<size_t>(i)];
  if (s1) s.stateful[static_cast<size_t>(i)] = 1;
  detail::update(algorithm_, h_, step, first, w, s.param->dtype().id(), g, gd, s1, s2, state_dtype_,
                 s.tiled ? s.tiled->tile_size() : s.param->layout.cosize());
  counts_.tiles_stepped++;
}

void Optimizer::step_tile_in_backward(size_t k, int64_t i) {
  std::lock_guard lock(mutex_);
  const char* name = algorithm_name(algorithm_);
  Slot& s = *slots_[k];
  TensorPtr g;
  {
    std::lock_guard glock(s.param->mutex);
    g = s.param->grad;
  }
  // Only a gradient step() would take; anything else is left for step() to report.
  auto G = g ? std::dynamic_pointer_cast<TiledEvictable>(g->carrier) : nullptr;
  if (!G || G->is_released() || !detail::float_dtype(g->dtype()) || !(g->layout == s.param->layout) ||
      g->offset != s.param->offset || !(G->geometry() == s.tiled->geometry()) ||
      G->tile_state(G->tile_coord(i)).location == TileLocation::Implicit)
    return;
  const TensorPtr state1 = uses_state1() ? s.state1 : nullptr;
  auto* S1 = state1 ? static_cast<TiledEvictable*>(state1->carrier.get()) : nullptr;
  auto* S2 = s.state2 ? static_cast<TiledEvictable*>(s.state2->carrier.get()) : nullptr;
  if (const auto& budget = s.tiled->residency_budget()) {  // step() raises for this
    const int64_t sb = state_bytes(s.tiled->tile_size());
    if (s.tiled->tile_bytes() + G->tile_bytes() + (S1 ? sb : 0) + (S2 ? sb : 0) > budget->max_bytes()) return;
  }
  Hold hw = hold_resident(*s.tiled, i, "weight", name);
  Hold hg = hold_resident(*G, i, "gradient", name);
  Hold h1 = S1 ? hold_resident(*S1, i, "optimizer state", name) : nullptr;
  Hold h2 = S2 ? hold_resident(*S2, i, "optimizer state", name) : nullptr;
  update_tile(s, i, hw->data(), hg->data(), g->dtype().id(), h1 ? h1->data() : nullptr, h2 ? h2->data() : nullptr);
  hw->commit();
  if (h1) h1->commit();
  if (h2) h2->commit();
  hg->commit_zero();  // consumed: never written
  s.stepped_in_backward[static_cast<size_t>(i)] = 1;
  counts_.tiles_stepped_in_backward++;
}

}  // namespace sw::optim
