// strideweave/moe.hpp — SparseMoE: a sparse Mixture-of-Experts block with SwiGLU experts whose weights are tiled.
//
//   out[t] = sum_j w[t, j] * W2_e (silu(W1_e x_t) * (W3_e x_t)),  e = idx[t, j]
//
// w1, w3: full tensors of shape (I, H, E) over TiledEvictables with one tile per expert (grid (1, 1, E), tile
// (I, H, 1)); w2: (H, I, E), tile (H, I, 1). Any within-tile order (PyTorch's row-major (out, in) tiles of a
// checkpoint, or column-major ones). All three share one dtype, the block's: Float32, BFloat16 or Float16.
//
// Routing (route): logits = matmul(x, router_weight) in the block's dtype, probs = softmax(Float32(logits)),
// (top, idx) = topk(probs, k), top /= sum(top) when `normalize`, then cast to the routing dtype (Float32, or the
// block's dtype). Recorded with autograd like any chain of operations.
// Experts (experts): one autograd node (Note [A sparse MoE block] in cpp/src/moe/sparse_moe.cpp) with inputs
// (x, routing weights) whose backward also adds the experts' weight gradients into w1.grad, w2.grad, w3.grad.
//
// Memory (Note [A sparse MoE block]): the node saves x, the routing and per-expert activations (T k (2I + H)
// elements), never weights; backward projects each routed expert's tiles again under the residency budget.
//
// Errors (nothing changed): TypeError for kinds and dtypes, ValueError for shapes, grids and top_k, IndexError for
// expert indices out of range; every message starts with "SparseMoE".
//
// Thread-safety: one call at a time per block (calls on one block from several threads are serialised by a
// mutex); the block holds its weight tensors.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <variant>

#include "strideweave/completion.hpp"
#include "strideweave/tensor.hpp"
#include "strideweave/tiled/residency_budget.hpp"

namespace sw {

struct MoEStats {
  int64_t calls = 0;           // forward (or experts) calls
  int64_t expert_visits = 0;   // experts visited, forward and backward
  int64_t hits = 0;            // visits whose three tiles were already resident when requested
  int64_t tiles_promoted = 0;  // weight tiles promoted by the block's requests (prefetch included)
  int64_t bytes_promoted = 0;
  double wait_seconds = 0;     // time forward and backward waited for tiles
};

struct MoEShared;  // the state the block shares with its autograd nodes (cpp/src/moe/internal.hpp)

class SparseMoE {
 public:
  // `routing_dtype` null means Float32. `budget` null leaves the carriers as they are; otherwise the three
  // carriers (and so their gradients) draw from it.
  // Blocks: set_residency_budget (evictions when the carriers already exceed the budget).
  SparseMoE(TensorPtr w1, TensorPtr w2, TensorPtr w3, int64_t top_k, bool normalize, const DType* routing_dtype,
            std::shared_ptr<ResidencyBudget> budget);

  struct Routing {
    TensorPtr logits;   // (T, E), the block's dtype
    TensorPtr weights;  // (T, k), the routing dtype
    TensorPtr indices;  // (T, k), Int32
  };
  // x (T, H) and router_weight (E, H): CPU tensors of the block's dtype.
  // Blocks: waits for the tiles (I/O), computes.
  TensorPtr forward(const TensorPtr& x, const TensorPtr& router_weight);
  Routing route(const TensorPtr& x, const TensorPtr& router_weight);
  // The expert part alone: weights (T, k) of the routing dtype, indices (T, k) Int32, both CPU tensors.
  TensorPtr experts(const TensorPtr& x, const TensorPtr& weights, const TensorPtr& indices);
  // Starts promoting the tiles of the experts named in `indices` (any shape, Int32), as many as the budget
  // holds beside one working expert, first named first; null when nothing needs promoting. Never waits for I/O.
  CompletionPtr<std::monostate> prefetch(const TensorPtr& indices);

  MoEStats stats() const;
  void reset_stats();

  const TensorPtr& w1() const;
  const TensorPtr& w2() const;
  const TensorPtr& w3() const;
  int64_t top_k() const;
  bool normalize() const;
  int64_t num_experts() const;
  int64_t hidden_size() const;
  int64_t intermediate_size() const;
  const DType& dtype() const;
  const DType& routing_dtype() const;
  const std::shared_ptr<ResidencyBudget>& budget() const;
  // How many experts a forward (or backward) keeps in flight beside the one it computes: 1, or 0 under a
  // budget too small for two experts' tiles (weights, plus their Float32 gradients in backward).
  int64_t prefetch_depth(bool backward) const;

 private:
  std::shared_ptr<MoEShared> s_;
};

}  // namespace sw
