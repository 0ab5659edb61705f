// SparseMoE (strideweave/moe.hpp): validation, routing, prefetch, statistics and the per-expert projections. The
// expert computation and its autograd node are in experts_node.cpp.
//
// Note [A sparse MoE block]: out[t] = sum_j w[t, j] W2_e (silu(W1_e x_t) * W3_e x_t), e = idx[t, j], with one
// tile per expert in each of three TiledEvictables (docs/guide.md, "SparseMoE").
//  * Routing is a chain of ordinary operations recorded by autograd (matmul, a cast, softmax, topk, reduce_sum,
//    div, a cast): small (T, E) tensors.
//  * Dispatch is a counting sort of the (T, k) indices: per routed expert the tokens sent to it, ascending.
//  * The expert part is one node. Forward visits the routed experts in ascending order (the order transformers'
//    loop adds them in). Each visit projects the expert's three tiles as one-tile projections, which share the
//    resident tile's memory (Note [Shared snapshots]: no weight is copied), computes h1 = x_e W1^T,
//    h3 = x_e W3^T, h = silu(h1) * h3, y = h W2^T, each result rounded to the block's dtype as PyTorch rounds
//    it, scales y by the routing weight (a Float32 product for Float32 weights, rounded to the block's dtype)
//    and adds it into the output row (rounded to the block's dtype after each expert, like index_add_ into a
//    16-bit output). While one expert computes, the next one's projections are in flight (prefetch depth 1:
//    at most two experts' weight tiles are pinned or held at once; depth 0 under a budget smaller than two
//    experts' tiles, and in backward than two experts' tiles and their Float32 gradient tiles).
//  * The node saves x, the routing and per expert h1, h3 and y (T k (2I + H) elements), never a weight: the
//    generic matmul VJP would keep every routed expert's tiles alive until backward. Backward visits the experts
//    in reverse (the most recently resident first), projects their tiles again (promotions under the budget;
//    these projections are recorded, so their VJPs reach the tiled .grad), and computes
//      dY = g[tokens] w (rounded to the block's dtype), dw[t, j] = <g_t, y_t> (Float32),
//      dA = dY W2, a = silu(h1), dh3 = dA * a, dh1 = (dA * h3) silu'(h1) (each rounded to the block's dtype),
//      dW2 = dY^T (a * h3), dW1 = dh1^T x_e, dW3 = dh3^T x_e (block-dtype products accumulated in Float32),
//      dx_e = dh1 W1 + dh3 W3 (one Float32 sum rounded to the block's dtype, added into dx in Float32; a 16-bit
//      tile is widened once into a scratch buffer for dA and dx_e, which contract over its non-contiguous index),
//    then adds each dW into the .grad tile: in place when that tile is resident and only the leaf holds the
//    gradient (the conditions of Note [Gradient sinks]), else through backward of the tile's projection, whose
//    VJP does the same through a fresh one-tile gradient (Float32 sums for 16-bit parameters either way: Note
//    [Tiled gradients of 16-bit parameters]); then it drops the expert's tiles.
//    The budget bounds weights and gradients together, as for any projection (Note [One residency budget]).
#include "internal.hpp"

#include "../ops/dense.hpp"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "strideweave/autograd.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "strideweave/views.hpp"

namespace sw {

namespace {

constexpr const char* kWeightNames[3] = {"w1", "w2", "w3"};

// A cast with autograd: the values converted (rounded once when narrowing), the gradient passed on in Float32.
struct CastNode final : Node {
  std::vector<TensorPtr> apply(const TensorPtr& g) override { return {g}; }
};

TensorPtr cast(const TensorPtr& t, const DType& dtype) {
  if (t->dtype() == dtype) return t;
  const auto& ext = t->layout.flat().extents;
  TensorPtr r = moe::tensor_of(moe::floats_of(*t), ext[0], ext[1], dtype);
  const TensorPtr in[1] = {t};
  if (should_record(in, r)) {
    auto node = std::make_shared<CastNode>();
    node->name = "cast";
    node->dispatch_kind = &r->carrier->kind();
    node->inputs = {t};
    attach_node(node, r);
  }
  return r;
}

std::vector<int64_t> extents_of(const TensorImpl& t) {
  std::vector<int64_t> e;
  for (size_t k = 0; k < t.layout.rank(); ++k) e.push_back(t.layout.shape().tree()[k].is_leaf()
                                                                ? t.layout.shape().tree()[k].value()
                                                                : -1);
  return e;
}

std::string extents_str(const std::vector<int64_t>& e) {
  std::string s = "(";
  for (size_t i = 0; i < e.size(); ++i) s += (i ? ", " : "") + std::to_string(e[i]);
  return s + (e.size() == 1 ? ",)" : ")");
}

moe::Weight weight_of(const TensorPtr& t, const char* name) {
  if (!t) raise<TypeError>("SparseMoE: ", name, " must be a Tensor");
  auto c = std::dynamic_pointer_cast<TiledEvictable>(t->carrier);
  if (!c)
    raise<TypeError>("SparseMoE: ", name, " must be a tensor over a TiledEvictable (one tile per expert), got a ",
                     t->carrier->kind_name(), " tensor");
  c->check_live("use it as SparseMoE weights");
  const DType& dt = t->dtype();
  if (dt != DType::Float32() && dt != DType::BFloat16() && dt != DType::Float16())
    raise<TypeError>("SparseMoE: ", name, " must be Float32, BFloat16 or Float16, got ", dt.name());
  return {t, c};
}

// A two-mode CPU tensor of `dtype` and extents (rows, cols).
void check_matrix(const TensorPtr& t, const char* what, const DType& dtype, int64_t rows, int64_t cols,
                  const char* rows_name, const char* cols_name) {
  if (!t) raise<TypeError>("SparseMoE: ", what, " must be a Tensor");
  if (&t->carrier->kind() != &cpu_kind())
    raise<TypeError>("SparseMoE: ", what, " must be a CPU tensor, got a ", t->carrier->kind_name(), " tensor");
  t->carrier->check_live("use it in SparseMoE");
  if (t->dtype() != dtype)
    raise<TypeError>("SparseMoE: ", what, " must be ", dtype.name(), ", got ", t->dtype().name());
  const std::vector<int64_t> e = extents_of(*t);
  if (e.size() != 2 || e[0] < 0 || (rows >= 0 && e[0] != rows) || e[1] != cols)
    raise<ValueError>("SparseMoE: ", what, " must have shape (", rows >= 0 ? std::to_string(rows) : rows_name, ", ",
                      cols, ") (", rows_name, ", ", cols_name, "), got ", t->layout.shape().str());
}

// Expert indices in [0, experts) (IndexError naming the first bad one).
std::vector<double> expert_indices(const TensorPtr& indices, int64_t experts, const char* what) {
  std::vector<double> v = detail::read_doubles(*indices);
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] < 0 || v[i] >= static_cast<double>(experts))
      raise<IndexError>("SparseMoE: ", what, " holds expert ", static_cast<int64_t>(v[i]), " at ordinal ", i,
                        ", outside [0, ", experts, ")");
  return v;
}

}  // namespace

// ---------------------------------------------------------------- shared state

void MoEShared::add_wait(double seconds) {
  std::lock_guard lock(stats_mutex);
  stats.wait_seconds += seconds;
}

void MoEShared::settle_prefetches() {
  if (in_flight.empty()) return;
  const auto t0 = moe::Clock::now();
  std::vector<CompletionPtr<std::monostate>> pending;
  pending.swap(in_flight);
  for (auto& c : pending) c->wait();  // a failed prefetch fails nothing: the work promotes the tile itself
  in_flight_experts.clear();
  add_wait(std::chrono::duration<double>(moe::Clock::now() - t0).count());
}

std::pair<int64_t, int64_t> MoEShared::promotions() const {
  int64_t tiles = 0, bytes = 0;
  for (const auto& x : w) {
    TiledStats st = x.carrier->stats();
    tiles += st.promotions;
    bytes += st.bytes_promoted;
  }
  return {tiles, bytes};
}

namespace moe {

ExpertTiles start_expert(MoEShared& s, int64_t e, bool record) {
  ExpertTiles t;
  t.expert = e;
  t.hit = true;
  for (const auto& w : s.w) t.hit &= w.carrier->tile_state({0, 0, e}).location == TileLocation::Primary;
  GradModeGuard mode(record);
  for (size_t i = 0; i < 3; ++i) t.pending[i] = project(s.w[i].carrier, s.w[i].full, TileSelection{{{0}, {0}, {e}}}, nullptr);
  {
    std::lock_guard lock(s.stats_mutex);
    s.stats.expert_visits++;
    if (t.hit) s.stats.hits++;
  }
  return t;
}

void finish_expert(MoEShared& s, ExpertTiles& t) {
  const auto t0 = Clock::now();
  for (size_t i = 0; i < 3; ++i) {
    t.compact[i] = t.pending[i]->value();
    t.pending[i] = nullptr;
    t.matrix[i] = matrix_of(t.compact[i]);
  }
  s.add_wait(std::chrono::duration<double>(Clock::now() - t0).count());
}

Dispatch dispatch(const std::vector<double>& indices, int64_t tokens, int64_t k, int64_t experts) {
  std::vector<int64_t> count(static_cast<size_t>(experts), 0), slot(static_cast<size_t>(experts), -1);
  for (double e : indices) count[static_cast<size_t>(e)]++;
  Dispatch d;
  for (int64_t e = 0; e < experts; ++e)
    if (count[static_cast<size_t>(e)]) {
      slot[static_cast<size_t>(e)] = static_cast<int64_t>(d.experts.size());
      d.experts.push_back(e);
      d.tokens.emplace_back().reserve(static_cast<size_t>(count[static_cast<size_t>(e)]));
      d.positions.emplace_back().reserve(static_cast<size_t>(count[static_cast<size_t>(e)]));
    }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pos = t + tokens * j;
      const auto s = static_cast<size_t>(slot[static_cast<size_t>(indices[static_cast<size_t>(pos)])]);
      d.tokens[s].push_back(static_cast<int32_t>(t));
      d.positions[s].push_back(pos);
    }
  return d;
}

}  // namespace moe

// ---------------------------------------------------------------- SparseMoE

SparseMoE::SparseMoE(TensorPtr w1, TensorPtr w2, TensorPtr w3, int64_t top_k, bool normalize,
                     const DType* routing_dtype, std::shared_ptr<ResidencyBudget> budget)
    : s_(std::make_shared<MoEShared>()) {
  const TensorPtr given[3] = {w1, w2, w3};
  std::array<moe::Weight, 3> w;
  for (size_t i = 0; i < 3; ++i) w[i] = weight_of(given[i], kWeightNames[i]);
  const DType& dt = w[0].full->dtype();
  for (size_t i = 1; i < 3; ++i)
    if (w[i].full->dtype() != dt)
      raise<TypeError>("SparseMoE: w1, w2 and w3 must share one dtype; w1 is ", dt.name(), ", ", kWeightNames[i],
                       " is ", w[i].full->dtype().name());
  std::vector<int64_t> e1 = extents_of(*w[0].full);
  if (e1.size() != 3 || e1[0] < 1 || e1[1] < 1 || e1[2] < 1)
    raise<ValueError>("SparseMoE: w1 must have shape (I, H, E) (three flat modes), got ",
                      w[0].full->layout.shape().str());
  const int64_t I = e1[0], H = e1[1], E = e1[2];
  const std::vector<int64_t> want[3] = {{I, H, E}, {H, I, E}, {I, H, E}};
  for (size_t i = 0; i < 3; ++i) {
    if (extents_of(*w[i].full) != want[i])
      raise<ValueError>("SparseMoE: ", kWeightNames[i], " must have shape ", extents_str(want[i]),
                        i == 1 ? " (H, I, E)" : " (I, H, E)", " given w1 ", extents_str(e1), ", got ",
                        w[i].full->layout.shape().str());
    const std::vector<int64_t> grid{1, 1, E}, tile{want[i][0], want[i][1], 1};
    if (w[i].carrier->grid_shape() != grid || w[i].carrier->tile_shape() != tile)
      raise<ValueError>("SparseMoE: ", kWeightNames[i], " must have one tile per expert: grid (1, 1, ", E,
                        ") and tile ", extents_str(tile), ", got grid ", extents_str(w[i].carrier->grid_shape()),
                        " and tile ", extents_str(w[i].carrier->tile_shape()));
    w[i].carrier->check_footprints(*w[i].full);
    for (size_t j = 0; j < i; ++j)
      if (w[j].carrier == w[i].carrier)
        raise<ValueError>("SparseMoE: ", kWeightNames[j], " and ", kWeightNames[i],
                          " must be tensors over distinct TiledEvictables");
  }
  if (top_k < 1 || top_k > E)
    raise<ValueError>("SparseMoE: top_k must be in [1, ", E, "] (the number of experts), got ", top_k);
  const DType& routing = routing_dtype ? *routing_dtype : DType::Float32();
  if (routing != DType::Float32() && routing != dt)
    raise<TypeError>("SparseMoE: routing_dtype must be Float32 or the block's dtype ", dt.name(), ", got ",
                     routing.name());
  if (budget)
    for (size_t i = 0; i < 3; ++i)
      if (w[i].carrier->residency_budget() && w[i].carrier->residency_budget() != budget)
        raise<ValueError>("SparseMoE: ", kWeightNames[i], "'s carrier already draws from another ResidencyBudget");
  // Validated: from here on the block changes things.
  if (budget)
    for (size_t i = 0; i < 3; ++i) {
      w[i].carrier->set_residency_budget(budget);
      // A gradient made before the carrier joined joins too (later ones do through allocate_like).
      TensorPtr g;
      {
        std::lock_guard lock(w[i].full->mutex);
        g = w[i].full->grad;
      }
      if (g)
        if (auto gc = std::dynamic_pointer_cast<TiledEvictable>(g->carrier); gc && !gc->residency_budget())
          gc->set_residency_budget(budget);
    }
  s_->w = w;
  s_->top_k = top_k;
  s_->experts = E;
  s_->hidden = H;
  s_->inter = I;
  s_->normalize = normalize;
  s_->dtype = &dt;
  s_->routing = &routing;
  s_->budget = std::move(budget);
  s_->expert_bytes = 0;
  for (const auto& x : w) s_->expert_bytes += x.carrier->tile_bytes();
  auto [tiles, bytes] = s_->promotions();
  s_->stats.tiles_promoted = -tiles;  // stats() adds the carriers' counters: promotions since construction
  s_->stats.bytes_promoted = -bytes;
}

SparseMoE::Routing SparseMoE::route(const TensorPtr& x, const TensorPtr& router_weight) {
  const MoEShared& s = *s_;
  check_matrix(x, "x", *s.dtype, -1, s.hidden, "T", "H");
  check_matrix(router_weight, "router_weight", *s.dtype, s.experts, s.hidden, "E", "H");
  const int64_t T = extents_of(*x)[0];
  if (T < 1) raise<ValueError>("SparseMoE: x must hold at least one token");
  Routing r;
  const Operand mm[2] = {Operand::of(x), Operand::of(router_weight)};
  r.logits = call_op(OpId::Matmul, mm);
  TensorPtr probs = softmax(cast(r.logits, DType::Float32()), 1);
  auto [top, idx] = topk(probs, s.top_k, 1);
  if (s.normalize) {
    OpOptions sum_options;
    sum_options.description = "a b -> a";
    const Operand one[1] = {Operand::of(top)};
    TensorPtr sum = reshape(call_op(OpId::ReduceSum, one, sum_options), std::vector<int64_t>{T, 1});
    const Operand q[2] = {Operand::of(top), Operand::of(sum)};
    top = call_op(OpId::Div, q);
  }
  r.weights = cast(top, *s.routing);
  r.indices = idx;
  return r;
}

TensorPtr SparseMoE::forward(const TensorPtr& x, const TensorPtr& router_weight) {
  Routing r = route(x, router_weight);
  return experts(x, r.weights, r.indices);
}

TensorPtr SparseMoE::experts(const TensorPtr& x, const TensorPtr& weights, const TensorPtr& indices) {
  const MoEShared& s = *s_;
  check_matrix(x, "x", *s.dtype, -1, s.hidden, "T", "H");
  const int64_t T = extents_of(*x)[0];
  if (T < 1) raise<ValueError>("SparseMoE: x must hold at least one token");
  check_matrix(weights, "weights", *s.routing, T, s.top_k, "T", "top_k");
  check_matrix(indices, "indices", DType::Int32(), T, s.top_k, "T", "top_k");
  (void)expert_indices(indices, s.experts, "indices");
  for (const auto& w : s.w) w.carrier->check_live("run SparseMoE");
  return moe::run_experts(s_, x, weights, indices);
}

CompletionPtr<std::monostate> SparseMoE::prefetch(const TensorPtr& indices) {
  MoEShared& s = *s_;
  if (!indices) raise<TypeError>("SparseMoE.prefetch: indices must be a Tensor");
  if (indices->dtype() != DType::Int32())
    raise<TypeError>("SparseMoE.prefetch: indices must be Int32, got ", indices->dtype().name());
  std::vector<double> v = expert_indices(indices, s.experts, "prefetch's indices");
  std::lock_guard lock(s.call_mutex);
  // The first named experts, as many as fit beside one expert at work.
  int64_t room = s.experts;
  if (s.budget) room = std::max<int64_t>(0, s.budget->max_bytes() / std::max<int64_t>(s.expert_bytes, 1) - 1);
  std::vector<int64_t> chosen;
  std::unordered_set<int64_t> seen;
  for (double d : v) {
    const auto e = static_cast<int64_t>(d);
    if (static_cast<int64_t>(chosen.size()) >= room) break;
    if (seen.insert(e).second) chosen.push_back(e);
  }
  // Experts of a prefetch still in flight are left to it (a tile in a residency request refuses another).
  std::erase_if(s.in_flight, [](const CompletionPtr<std::monostate>& c) { return c->done(); });
  if (s.in_flight.empty()) s.in_flight_experts.clear();
  std::erase_if(chosen, [&](int64_t e) { return s.in_flight_experts.count(e) != 0; });
  std::vector<CompletionPtr<std::monostate>> requests;
  for (const auto& w : s.w) {
    std::vector<int64_t> tiles;
    for (int64_t e : chosen)
      if (w.carrier->tile_state({0, 0, e}).location == TileLocation::Secondary) tiles.push_back(w.carrier->tile_index({0, 0, e}));
    if (!tiles.empty()) requests.push_back(w.carrier->promote_async(tiles));
  }
  if (requests.empty()) return nullptr;
  auto all = std::make_shared<Completion<std::monostate>>();
  struct Count {
    std::mutex m;
    size_t left;
    std::exception_ptr error;
  };
  auto count = std::make_shared<Count>();
  count->left = requests.size();
  for (auto& r : requests)
    r->then([r, all, count] {
      std::exception_ptr error;
      bool last;
      {
        std::lock_guard l(count->m);
        if (auto e = r->error(); e && !count->error) count->error = e;
        last = --count->left == 0;
        error = count->error;
      }
      if (!last) return;
      if (error) all->set_error(error);
      else all->set_value({});
    });
  s.in_flight.push_back(all);
  s.in_flight_experts.insert(chosen.begin(), chosen.end());
  return all;
}

MoEStats SparseMoE::stats() const {
  MoEStats out;
  {
    std::lock_guard lock(s_->stats_mutex);
    out = s_->stats;
  }
  auto [tiles, bytes] = s_->promotions();
  out.tiles_promoted += tiles;
  out.bytes_promoted += bytes;
  return out;
}

void SparseMoE::reset_stats() {
  auto [tiles, bytes] = s_->promotions();
  std::lock_guard lock(s_->stats_mutex);
  s_->stats = MoEStats{};
  s_->stats.tiles_promoted = -tiles;
  s_->stats.bytes_promoted = -bytes;
}

const TensorPtr& SparseMoE::w1() const { return s_->w[0].full; }
const TensorPtr& SparseMoE::w2() const { return s_->w[1].full; }
const TensorPtr& SparseMoE::w3() const { return s_->w[2].full; }
int64_t SparseMoE::top_k() const { return s_->top_k; }
bool SparseMoE::normalize() const { return s_->normalize; }
int64_t SparseMoE::num_experts() const { return s_->experts; }
int64_t SparseMoE::hidden_size() const { return s_->hidden; }
int64_t SparseMoE::intermediate_size() const { return s_->inter; }
const DType& SparseMoE::dtype() const { return *s_->dtype; }
const DType& SparseMoE::routing_dtype() const { return *s_->routing; }
const std::shared_ptr<ResidencyBudget>& SparseMoE::budget() const { return s_->budget; }
int64_t SparseMoE::prefetch_depth(bool backward) const { return s_->depth(backward); }

int64_t MoEShared::depth(bool backward) const {
  if (!budget) return 1;
  // Float32 gradient tiles of one expert: tile slots times 4 bytes.
  const int64_t grads = expert_bytes / static_cast<int64_t>(slot_bytes(*dtype)) * 4;
  const int64_t need = 2 * expert_bytes + (backward ? 2 * grads : 0);
  return budget->max_bytes() >= need ? 1 : 0;
}

}  // namespace sw
