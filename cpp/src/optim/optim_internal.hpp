// optim/optim_internal.hpp — what optimizer.cpp, step.cpp and update.cpp share (never a public header).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "strideweave/dtype.hpp"
#include "strideweave/optim.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace sw::optim {

// One parameter: its carrier (tiled or dense), its state tensors and per-tile step counts.
struct Optimizer::Slot {
  TensorPtr param;
  std::shared_ptr<TiledEvictable> tiled;  // null for a dense parameter
  TensorPtr state1, state2;               // momentum buffer or exp_avg; exp_avg_sq (of the state dtype)
  std::vector<int64_t> steps;             // per tile
  // Per tile: 1 once its state holds a value (an Adam tile stepped; an SGD tile stepped with momentum, so its next
  // step with momentum updates the buffer instead of starting it from the gradient, as torch's buffer is not None).
  std::vector<uint8_t> stateful;
  // Step in backward (Note [Stepping in backward]), tiled parameters: per tile, the recorded uses outstanding
  // (Note [Gradient reservations]) and whether it was stepped in backward since step() last ran.
  std::vector<int32_t> reserved;
  std::vector<uint8_t> stepped_in_backward;
  std::shared_ptr<TileGradientHook> hook;
};

// The hooks' way to their optimizer: cleared (under `m`) when the optimizer goes; a hook holds `m` while it calls
// into the optimizer, so it never reaches one being destroyed.
struct Optimizer::Link {
  std::mutex m;
  Optimizer* optimizer = nullptr;
};

}  // namespace sw::optim

namespace sw::optim::detail {

inline bool float_dtype(const DType& d) {
  return d.id() == DTypeId::Float32 || d.id() == DTypeId::BFloat16 || d.id() == DTypeId::Float16;
}

inline void add_traffic(TierTraffic& a, int64_t promotions, int64_t evictions, int64_t promoted, int64_t evicted) {
  a.promotions += promotions;
  a.evictions += evictions;
  a.bytes_promoted += promoted;
  a.bytes_evicted += evicted;
}
inline void add_traffic(TierTraffic& a, const TiledStats& s) {
  add_traffic(a, s.promotions, s.evictions, s.bytes_promoted, s.bytes_evicted);
}
// What happened between two readings of a carrier's stats.
inline void add_traffic(TierTraffic& a, const TiledStats& before, const TiledStats& after) {
  add_traffic(a, after.promotions - before.promotions, after.evictions - before.evictions,
              after.bytes_promoted - before.bytes_promoted, after.bytes_evicted - before.bytes_evicted);
}

// One update of n values in place: the weight `w` (dtype wd), its gradient `g` (dtype gd), the state s1
// (momentum buffer or exp_avg; null when none) and s2 (exp_avg_sq), stored as `sd` (BFloat16 state is widened to
// Float32 for the update and rounded once, nearest even, when stored), at the tile's step count `step` (1 on its
// first step); `first`: SGD's momentum buffer starts as the gradient (the tile had no buffer yet). A 16-bit weight is widened, updated in Float32 and rounded once (nearest even).
// Blocks: runs on the compute pool (a large tile is split over the cores).
void update(Algorithm a, const Hyperparameters& h, int64_t step, bool first, void* w, DTypeId wd, const void* g, DTypeId gd,
            void* s1, void* s2, StateDType sd, int64_t n);

}  // namespace sw::optim::detail
