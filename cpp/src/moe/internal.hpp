// Internal: the state a SparseMoE shares with its autograd nodes, the per-expert projections and the dense helpers
// of the expert computation (cpp/src/moe/*.cpp).
#pragma once

#include <array>
#include <chrono>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "strideweave/completion.hpp"
#include "strideweave/fork.hpp"
#include "strideweave/moe.hpp"
#include "strideweave/ops.hpp"
#include "strideweave/tiled/data.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace sw::moe {

struct Weight {
  TensorPtr full;                          // (rows, cols, E) over `carrier`
  std::shared_ptr<TiledEvictable> carrier;
};

}  // namespace sw::moe

namespace sw {

struct MoEShared {
  std::array<moe::Weight, 3> w;  // w1, w2, w3
  int64_t top_k = 0, experts = 0, hidden = 0, inter = 0;
  bool normalize = true;
  const DType* dtype = nullptr;
  const DType* routing = nullptr;
  std::shared_ptr<ResidencyBudget> budget;
  int64_t expert_bytes = 0;  // the three weight tiles of one expert

  // One call (forward, backward, prefetch) at a time; a forked child never waits for a parent's call (fork.hpp).
  CallMutex call_mutex{"SparseMoE"};
  mutable std::mutex stats_mutex;
  MoEStats stats;
  // Prefetch requests still in flight: work on their tiles waits for them first (a tile in a residency request
  // refuses work meanwhile).
  std::vector<CompletionPtr<std::monostate>> in_flight;
  std::unordered_set<int64_t> in_flight_experts;

  // Waits for the prefetches in flight (their time counts as wait time). Call with call_mutex held.
  void settle_prefetches();
  void add_wait(double seconds);
  // The tiled carriers' promotion counters, summed (for the stats' deltas).
  std::pair<int64_t, int64_t> promotions() const;
  // SparseMoE::prefetch_depth.
  int64_t depth(bool backward) const;
};

namespace moe {

using Clock = std::chrono::steady_clock;

// The three weight tiles of one expert, projected (or being projected) as one tile each.
struct ExpertTiles {
  int64_t expert = -1;
  std::array<CompletionPtr<TensorPtr>, 3> pending;
  std::array<TensorPtr, 3> compact;  // (rows, cols, 1) as projected (autograd-visible when recorded)
  std::array<TensorPtr, 3> matrix;   // the same memory as (rows, cols)
  bool hit = false;
};

// Starts projecting expert `e`'s three tiles (recording projection nodes when `record`); `hit` says whether all
// three were resident. Waits for nothing.
ExpertTiles start_expert(MoEShared& s, int64_t e, bool record);
// Waits for the projections (counted as wait time) and fills `matrix`.
void finish_expert(MoEShared& s, ExpertTiles& t);

// Dense helpers (CPU, column-major (rows, cols) unless said otherwise).
// The values of `t` in ordinal order (column-major for two modes), widened to Float32.
std::vector<float> floats_of(const TensorImpl& t);
// A fresh column-major CPU tensor of `dtype` holding `v` (rows x cols), rounded once to a 16-bit dtype.
TensorPtr tensor_of(const std::vector<float>& v, int64_t rows, int64_t cols, const DType& dtype);
// Rounds `v` in place to `dtype` (Float32: unchanged).
void round_to(std::vector<float>& v, const DType& dtype);
// A one-mode Int32 CPU tensor.
TensorPtr int_tensor(const std::vector<int32_t>& v);
// An operation with grad mode off.
TensorPtr op(OpId id, const TensorPtr& a, const TensorPtr& b = nullptr);
// A two-mode view of a (rows, cols, 1) tensor (same carrier, same strides).
TensorPtr matrix_of(const TensorPtr& compact);
// A (rows, cols, 1) view of a two-mode tensor.
TensorPtr compact_of(const TensorPtr& matrix);
// The transpose of a two-mode tensor (a view).
TensorPtr transposed(const TensorPtr& t);

// Per-expert dispatch: the (t, j) positions routed to each expert, tokens ascending.
struct Dispatch {
  std::vector<int64_t> experts;                 // routed experts, ascending
  std::vector<std::vector<int32_t>> tokens;     // per routed expert: token of each visit
  std::vector<std::vector<int64_t>> positions;  // per routed expert: ordinal t + T j in the (T, k) routing
};
Dispatch dispatch(const std::vector<double>& indices, int64_t tokens, int64_t k, int64_t experts);

// The expert computation with its node (experts_node.cpp). `indices` and `weights` validated.
TensorPtr run_experts(const std::shared_ptr<MoEShared>& s, const TensorPtr& x, const TensorPtr& weights,
                      const TensorPtr& indices);

}  // namespace moe
}  // namespace sw
