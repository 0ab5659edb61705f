// strideweave/optim.hpp — SGD, Adam and AdamW over tiled (and dense) parameters, stepped tile by tile.
//
// Note [Optimizers on tiled parameters]: a parameter is a tensor over the whole extent of a TiledEvictable (one
// tile per expert) or a dense tensor over CPU memory (one "tile": the whole tensor). Each tile is stepped as
// torch.optim steps one nn.Parameter:
//  * a tile whose gradient tile is an implicit zero (no backward touched it since the gradient was dropped) is
//    skipped entirely, as torch.optim skips a parameter whose .grad is None, and each tile keeps its own step count
//    (Adam's bias corrections use it). This differs from torch.optim over ONE fused (E, ...) parameter, which
//    moves every expert on every step;
//  * the state (SGD's momentum buffer, Adam's exp_avg and exp_avg_sq) is Float32 by default, or BFloat16 or 8-bit
//    block-wise when the optimizer is built with StateDType::BFloat16 or Int8Blockwise (Note [Compact optimizer
//    state]), held in TiledEvictables of the weight's geometry (8-bit: packed tiles, one per weight tile) beside
//    it: a primary tier of the weight's primary kind, a secondary tier of their own (an anonymous FileBacked
//    scratch file, removed on release), the weight's ResidencyBudget when it has one,
//    no residency policy; every tile is an implicit zero until its first step;
//  * a step brings one tile's weight, gradient and state tiles resident through the normal residency paths (so a
//    budget bounds them and evicts least recently used tiles to make room), updates them in place with one
//    vectorised Float32 pass (a 16-bit weight is read, updated in Float32 and rounded once), marks the weight and
//    state tiles dirty and lets them go; it then moves to the next tile with a gradient. With prefetch on, the
//    next tile's transfers are started before the current tile's update when they fit the budget;
//  * the arithmetic is torch.optim's single-tensor code path (torch 2.13) operation by operation, in Float32,
//    with a fused multiply-add exactly where torch's CPU kernels use one (add with alpha, lerp, addcmul); the
//    square root is correctly rounded (torch's vectorised sqrt through MKL is not: within 1 ulp).
// Design and the formulas: docs/guide.md, "Optimizers on tiled parameters".
//
// Note [Stepping in backward]: an optimizer built with step_in_backward steps each tile of a tiled parameter
// during backward, the moment its gradient is final (Note [Gradient reservations] in
// strideweave/tiled/gradient_hook.hpp: the last recorded use of the tile has delivered its contribution), while
// its weight tile is still resident from that backward; the gradient tile is then dropped (an implicit zero),
// never written to its scratch file. The update is the same per-tile update step() runs, on the same gradient
// value, so the result is bit-identical to stepping after backward. What it asks of the loop:
//  * step() is still called after every backward, as usual: it steps the dense parameters, any tile whose gradient
//    was not final within a backward (a graph freed without reaching it, retain_graph, a budget too small for the
//    step), and it closes the step: a tile stepped in backward refuses a new recorded use (RuntimeError at the
//    forward) until step() has run, so a second forward of the old step cannot read updated weights;
//  * gradient accumulation: the backwards of all but the last micro-batch run with accumulating on
//    (set_accumulating(true); Python: `with opt.no_step():`), which only adds into .grad; the last backward steps
//    each tile it reaches; step() steps those that only earlier micro-batches reached;
//  * the hyperparameters are those in force when the tile's gradient becomes final (set them before backward);
//  * excluded: clipping by the global norm needs every gradient before any step, so grad_norm and scale_grads
//    refuse parameters of such an optimizer (ValueError); clip in one pass by another rule, or step after backward.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strideweave/tensor.hpp"

namespace sw::optim {

enum class Algorithm { SGD, Adam, AdamW };
const char* algorithm_name(Algorithm a);

// Note [Compact optimizer state]: how the state tensors are stored. Float32 (the default): as computed.
// BFloat16: each state value is stored in BFloat16 (half the bytes: the state tiles, their scratch file, their
// share of the residency budget and of a state file), widened to Float32 (exact) for the update, which computes in
// Float32 exactly as with Float32 state (the weight's update uses the new Float32 state values), and rounded once,
// to nearest even, when stored back.
// Int8Blockwise: the 8-bit block-wise state of Dettmers et al. 2021 ("8-bit Optimizers via Block-wise
// Quantization"), as bitsandbytes' AdamW8bit stores it. Each state tile is cut in blocks of 256 consecutive values
// (in within-tile order; the tile's last block may be shorter); a block stores one Float32 absmax = max |x| and, per
// value, an 8-bit code: the index of the entry of a 256-entry dynamic quantization map (blockwise_quantization_map:
// signed for SGD's momentum buffer and Adam's exp_avg, unsigned for exp_avg_sq) nearest x / absmax (computed in
// Float32; a tie between two entries goes to the larger), read back as map[code] * absmax (one Float32 rounding; a
// block of absmax 0, such as a tile never stepped, reads as zeros). A step decodes a block to Float32, runs the
// Float32 update exactly as with Float32 state (the weight's update uses the new Float32 state values), and encodes
// the new values. The codes and absmax of a tile of n values are packed as raw bytes (absmax first, then the codes,
// zero-padded) into one tile of ceil((n + 4 * ceil(n / 256)) / 4) Float32 slots of the state carrier (grid: the
// weight's; tile: that many slots along the first axis): about n + n/64 bytes, a quarter of Float32 state and a
// 64th more, in the tiles, their scratch file, the residency budget (state_bytes) and a state file. The cost is
// precision: a value keeps about 2 significant decimal digits of its block's absmax (Note [The dynamic
// quantization map] in cpp/src/optim/quantized_state.cpp), and values far below their block's absmax round to 0.
enum class StateDType { Float32, BFloat16, Int8Blockwise };
const char* state_dtype_name(StateDType d);  // "Float32", "BFloat16", "Int8Blockwise"
// The 256 entries (ascending) of the dynamic quantization map of Int8Blockwise state: signed (in [-0.99296875, 1])
// or unsigned (in [0, 1]); both hold 0 and 1. Valid for the program's lifetime.
const float* blockwise_quantization_map(bool is_signed) noexcept;

struct Hyperparameters {
  double lr = 1e-3;
  // SGD
  double momentum = 0.0, dampening = 0.0;
  bool nesterov = false;
  // Adam / AdamW
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  // both (Adam: added to the gradient; AdamW: decoupled, the weight is scaled by 1 - lr * weight_decay)
  double weight_decay = 0.0;
};

// The hyperparameter rules of the constructor (and of set_hyperparameters): ValueError naming the algorithm and the
// value for lr < 0, weight_decay < 0; SGD: momentum < 0, a dampening that is not finite, nesterov without momentum
// or with dampening; Adam/AdamW: betas outside [0, 1), eps < 0 (NaN fails every rule).
void validate(Algorithm algorithm, const Hyperparameters& h);

// Bytes moved between the tiers of one kind of carrier (weights, gradients or optimizer state): the carriers'
// own TiledStats summed (a weight's counts include the transfers of its projections, not only the optimizer's).
struct TierTraffic {
  int64_t promotions = 0, evictions = 0;
  int64_t bytes_promoted = 0, bytes_evicted = 0;
};

struct OptimizerStats {
  int64_t steps = 0;          // step() calls
  int64_t tiles_stepped = 0;  // tiles updated, over every step
  int64_t tiles_skipped = 0;  // tiles whose gradient was an implicit zero or absent
  int64_t prefetches = 0;     // tiles whose transfers began while the previous tile was updated
  int64_t tiles_stepped_in_backward = 0;  // of tiles_stepped: in backward (Note [Stepping in backward])
  TierTraffic weights, gradients, state;
};

// One parameter's state: its per-tile step counts and its state tensors (Float32 or BFloat16: the state dtype) (same shape and layout as the
// parameter; null when the algorithm has none). Int8Blockwise state: decoded copies (map[code] * absmax, Float32,
// dense CPU tensors of the parameter's shape and layout, made by state(): the full Float32 size, for inspection;
// writing them changes nothing).
struct ParameterState {
  std::vector<int64_t> steps;  // one per tile (one for a dense parameter)
  TensorPtr momentum_buffer;   // SGD with momentum
  TensorPtr exp_avg, exp_avg_sq;  // Adam, AdamW
};

class Optimizer {
 public:
  // Validates everything before anything is allocated (nothing changes on error):
  //  ValueError: lr < 0, momentum < 0, weight_decay < 0, nesterov without momentum or with
  //    dampening, betas outside [0, 1), eps < 0, no parameters, a parameter listed twice (or two over one carrier),
  //    a parameter that is not a leaf (autograd computes it), a read-only parameter, a tiled parameter that is not
  //    the whole extent of its TiledEvictable (offset 0, one slot per element, tile footprints), a dense one that
  //    is not over CPU memory or not compact;
  //  TypeError: a parameter whose dtype is not Float32, BFloat16 or Float16.
  // Blocks: allocates the state carriers (their tiles are implicit: no storage yet).
  // `state_dtype`: how the state is stored (Note [Compact optimizer state]).
  // `step_in_backward`: Note [Stepping in backward]; installs a gradient hook on each tiled parameter (ValueError,
  // nothing changed, when another such optimizer already has one), removed by the destructor.
  Optimizer(Algorithm algorithm, std::vector<TensorPtr> params, Hyperparameters h,
            StateDType state_dtype = StateDType::Float32, bool step_in_backward = false);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  Algorithm algorithm() const noexcept { return algorithm_; }
  bool step_in_backward() const noexcept { return link_ != nullptr; }
  // Note [Stepping in backward]: while accumulating, backward only adds into .grad (micro-batches before the
  // last). Blocks: waits for a tile being stepped in backward.
  void set_accumulating(bool on);
  bool accumulating() const;
  StateDType state_dtype() const noexcept { return state_dtype_; }
  // A copy: set_hyperparameters may replace them from another thread. Blocks: waits for a running step.
  Hyperparameters hyperparameters() const;
  // Replaces the hyperparameters between steps; the next step uses them (torch's learning-rate schedulers change
  // lr before every step). Validated as the constructor validates them (validate): ValueError, nothing changed.
  // SGD: a momentum made nonzero on an optimizer built without one allocates the momentum buffers (implicit zeros);
  // a tile's buffer starts as torch's does, as a copy of its gradient, on the tile's first step with momentum, and a
  // momentum set back to 0 leaves the buffers as they are (unused) until it is nonzero again.
  // Blocks: waits for a running step.
  void set_hyperparameters(const Hyperparameters& h);
  const std::vector<TensorPtr>& params() const noexcept { return params_; }

  // One step over every parameter with a gradient, tile by tile (Note [Optimizers on tiled parameters]). Every
  // gradient is checked first (ValueError when its shape, layout, offset or geometry does not match its parameter,
  // TypeError when its dtype is not a float one), so a bad gradient changes nothing. An error while stepping (I/O,
  // a budget that cannot hold one tile of the weight, its gradient and its state together) leaves the tiles
  // stepped before it stepped.
  // Blocks: promotions and evictions (I/O) in this thread and the I/O pool; the update runs on the compute pool.
  void step();
  // Drops every parameter's gradient (.grad = None): nothing is allocated, the gradient carriers go when their
  // last reference does.
  void zero_grad();

  // The state of `param` (one of params(), by identity); ValueError otherwise. Int8Blockwise: decoded copies
  // (ParameterState). Blocks: Int8Blockwise reads every state tile from wherever it lies (I/O).
  ParameterState state(const TensorPtr& param) const;
  // Blocks: each carrier's tile-table lock, briefly.
  OptimizerStats stats() const;
  // Whether a step starts the next tile's promotions during the current tile's update. Off by default: measured
  // slower when the tiers are in the page cache and the cores are few (docs/guide.md, "Optimizers on tiled
  // parameters"); it can help when promotions wait on a device rather than on the CPU.
  void set_prefetch(bool on) noexcept { prefetch_ = on; }
  bool prefetch() const noexcept { return prefetch_; }

  // Note [Optimizer state files]: save_state writes the state to one safetensors file at `path` with
  // sw::safetensors::save (atomic: a temporary file renamed into place; the tiled state streamed tile range by tile
  // range from wherever each tile lies, never gathered). Parameter k's state tensors are "param{k}.momentum_buffer"
  // (SGD, once it has buffers) or "param{k}.exp_avg" and "param{k}.exp_avg_sq", of the state dtype (F32 or
  // BF16) and shape (tiles, tile size): row t is tile t's values in within-tile order (a dense parameter: one row of its slots), so a tile is
  // one contiguous byte range of the file; implicit tiles are written as zeros. Int8Blockwise state: F32 tensors of
  // shape (tiles, ceil((n + 4 ceil(n / 256)) / 4)) for tiles of n values, row t the raw bytes of packed tile t
  // (Note [Compact optimizer state]: the absmax of its blocks, then its codes, zero-padded), read back byte for
  // byte. The __metadata__ holds JSON strings:
  // "format" ("strideweave.optim.state/1"), "algorithm", "state_dtype" ("Float32", "BFloat16" or "Int8Blockwise";
  // a file without it is Float32), "hyperparameters" (an object), "params" (the count) and
  // per parameter "param{k}": {"shape", "grid", "tile", "step": per-tile step counts, "state_tiles": per tile 1 when
  // its state holds a value}.
  // Blocks: reads every state tile (I/O), writes and syncs the file.
  void save_state(const std::string& path) const;
  // Restores a file of save_state into this optimizer: state values, step counts and hyperparameters. The file is
  // checked whole first: ValueError naming what differs (a malformed file or metadata, another algorithm, another
  // parameter count, another state dtype, a parameter of another shape or tile grid, a state tensor missing or of
  // the wrong shape or dtype, hyperparameters that validate() refuses), nothing changed. Then each state tile that holds a value in
  // the file is made resident under the parameter's residency budget and held (an implicit tile becomes a zero
  // buffer), read from its byte range straight into its buffer and committed, one tile at a time (never the whole
  // state in memory); a tile that is an implicit zero in the file stays (or is written back to) zeros: one that is
  // implicit here stays implicit. An I/O error part-way leaves the tiles loaded before it loaded.
  // Blocks: the reads (I/O) and promotions in this thread.
  void load_state(const std::string& path);

 private:
  struct Slot;
  struct Link;
  class InBackward;
  void step_slot(Slot& s, const TensorPtr& grad);
  // Tile `i` of slot `k` stepped in backward from its gradient tile, which is then dropped; nothing when the
  // gradient is absent, implicit there or unusable (step() reports that). Blocks: as step().
  void step_tile_in_backward(size_t k, int64_t i);
  // One tile's update (the step count, the state's first use, the update pass) over held memory.
  void update_tile(Slot& s, int64_t i, void* w, const void* g, DTypeId gd, void* s1, void* s2);
  void install_hooks();
  void remove_hooks() noexcept;
  TensorPtr make_state(const Slot& s) const;
  // Whether a step reads and writes the first state tensor (SGD's momentum buffer only while momentum is nonzero).
  bool uses_state1() const noexcept { return algorithm_ != Algorithm::SGD || h_.momentum != 0; }
  // Bytes of one stored state tile of n values (Note [Compact optimizer state]): 4 n, 2 n, or the packed 8-bit tile.
  int64_t state_bytes(int64_t n) const noexcept;
  Algorithm algorithm_;
  StateDType state_dtype_ = StateDType::Float32;
  Hyperparameters h_;
  std::vector<TensorPtr> params_;
  std::vector<std::unique_ptr<Slot>> slots_;
  mutable std::mutex mutex_;  // one step (or state read) at a time
  OptimizerStats counts_;
  bool prefetch_ = false;
  bool accumulating_ = false;
  std::shared_ptr<Link> link_;  // step_in_backward: what the hooks reach this optimizer through
};

// Note [Gradients of tiled parameters together]: grad_norm and scale_grads read or scale the gradients of a list of
// parameters (tiled or dense, any Tensor with a .grad) in one pass over the gradient tiles, for clipping by the
// norm as torch.nn.utils.clip_grad_norm_ does. A tiled gradient must view the whole extent of its TiledEvictable
// (offset 0, each slot once); its implicit-zero tiles are skipped (they hold zeros, and scaling leaves them implicit)
// and every other tile is made resident through the ordinary promotions (under its ResidencyBudget, evicting least
// recently used tiles to make room) and held while it is read or scaled, one tile at a time. A dense gradient is
// read through its layout; scale_grads needs it in CPU memory, compact and mutable. A parameter without a gradient
// contributes nothing. Every argument and gradient is checked before any tile moves: TypeError for a null
// parameter and a gradient whose dtype is not Float32, BFloat16 or Float16, ValueError for a tiled gradient that
// is not its carrier's whole extent, a released carrier and (scale_grads) a dense gradient it cannot write.
// Blocks: promotions and evictions (I/O) in this thread.
//
// The norm of all the gradients' values together, accumulated in Float64 in tile order: for norm_type p > 0,
// (sum |x|^p)^(1/p) (p = 2: the square root of the sum of squares; p = 1: the sum of magnitudes), for p = +inf the
// largest magnitude (NaN when any value is NaN, as torch's). 0 when no parameter has a gradient. ValueError for
// p <= 0 or NaN. torch.nn.utils.get_total_norm computes the same value in the gradients' dtype.
double grad_norm(const std::vector<TensorPtr>& params, double norm_type);
// Multiplies every present gradient tile by `factor` in place: x * float(factor) rounded once to Float32, then,
// for a 16-bit gradient, rounded once more to its dtype (as torch's g.mul_(factor) computes), each scaled tile
// committed (dirty, version advanced).
void scale_grads(const std::vector<TensorPtr>& params, double factor);

}  // namespace sw::optim
