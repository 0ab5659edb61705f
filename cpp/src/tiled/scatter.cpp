// Scatter (data.hpp): the asynchronous counterpart of a projection into a fresh full-shaped TiledEvictable
// ("replace" or "add"), and its autograd node.
#include <sstream>
#include <utility>

#include "strideweave/autograd.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "tile_copies.hpp"

namespace sw {

namespace {

struct ScatterNode final : Node {
  std::shared_ptr<TiledEvictable> carrier;
  TileSelection selection;
  bool add = false;
  bool compact_input = false, template_input = false;  // which of inputs[] are present
  std::vector<TensorPtr> apply(const TensorPtr& g) override {
    // g is a full tiled cotangent of the result's carrier kind.
    auto gc = std::dynamic_pointer_cast<TiledEvictable>(g->carrier);
    SW_ASSERT(gc, "scatter backward received a ", g->carrier->kind_name(), " cotangent, not a TiledEvictable one");
    std::vector<TensorPtr> grads(inputs.size());
    TensorPtr selected;  // the cotangent at the saved selection, compact
    {
      GradModeGuard off(false);
      selected = project_for(gc, g, selection, nullptr, "backward")->value();
    }
    size_t slot = 0;
    if (compact_input) grads[slot++] = selected;
    // The result holds no template values outside the selection (those tiles are
    // invalid), and replace overwrote the selected ones: only add propagates to
    // the template, and only the selected cotangent.
    if (template_input && add) grads[slot] = scatter_add_gradient(carrier, inputs[slot], selection, selected);
    return grads;
  }
};

}  // namespace

CompletionPtr<TensorPtr> scatter(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& compact,
                                 const TensorPtr& templ, const TileSelection& sel, bool add) {
  if (!compact) raise<TypeError>("scatter: compact must be a Tensor");
  if (!templ) raise<TypeError>("scatter: template must be a Tensor");
  const CarrierKind& ck = compact->carrier->kind();
  if (ck.dependent) raise<TypeError>("scatter: compact must be backed by an ordinary carrier, not ", ck.name);
  if (&ck != &c->primary()->kind())
    raise<TypeError>("scatter: compact must be backed by ", c->primary()->kind_name(), " (the compute tier's class), got ",
                     ck.name);
  if (templ->carrier.get() != c.get()) raise<TypeError>("scatter: template must be backed by this TiledEvictable");
  c->check_live("scatter");
  compact->carrier->check_live("scatter it");
  if (compact->dtype() != c->dtype())
    raise<TypeError>("scatter: compact dtype ", compact->dtype().name(), " does not match ", c->dtype().name());
  if (add) {
    // "add" combines like the central add: its result dtype must be the one the fresh carrier keeps
    // (Bool + Bool is Float32 there, never a Bool), so a sum that cannot keep it is refused before any work.
    const Operand operands[] = {Operand::of(templ), Operand::of(compact)};
    const DType& sum = result_dtype(OpId::Add, operands, {});
    if (sum != c->dtype())
      raise<TypeError>("scatter: reduction 'add' of ", c->dtype().name(), " values gives ", sum.name(),
                       " values (as add does), which a ", c->dtype().name(),
                       " TiledEvictable cannot hold; use reduction 'replace', or scatter into a ", sum.name(),
                       " carrier");
  }
  c->check_footprints(*templ);
  std::vector<int64_t> src = bind_selection(*c, sel);
  std::vector<int64_t> cshape = compact_shape(*c, sel);
  if (compact->layout.shape().extents() != cshape) {
    std::ostringstream want;
    for (size_t i = 0; i < cshape.size(); ++i) want << (i ? ", " : "") << cshape[i];
    raise<ValueError>("scatter: compact shape ", compact->layout.shape().str(), " does not match the selected region (",
                      want.str(), ")");
  }
  const bool record = is_grad_enabled() && (compact->is_differentiable() || templ->is_differentiable());
  // An "add" reads the template's tiles: one work request, whose token ends it exactly once (in the job, or when
  // the job is dropped).
  auto work = add ? std::make_shared<WorkToken>(TiledInternals::begin_work(c, src, "scatter")) : nullptr;
  auto done = std::make_shared<Completion<TensorPtr>>();
  auto ccl = compact->carrier->claim("a scatter");
  auto job = [c, compact, templ, sel, add, work, done, src, record,
              claim = std::make_shared<Carrier::Claim>(std::move(ccl))]() mutable {
    try {
      if (work) work->ready()->value();
      auto fresh = std::static_pointer_cast<TiledEvictable>(c->allocate_like(c->size(), true, c->dtype(), true));
      TileAccess access(*c, *templ);
      std::vector<int64_t> counts = counts_of(sel);
      std::vector<std::pair<int64_t, CarrierPtr>> tiles;
      for (size_t k = 0; k < src.size(); ++k) {
        CarrierPtr existing = add ? TiledInternals::tile_buffer(*c, src[k]) : nullptr;
        tiles.emplace_back(src[k], scatter_tile(*c, access, src[k], *compact,
                                                TileGeometry::compact_coord(static_cast<int64_t>(k), counts), existing,
                                                add));
      }
      // A failed deferred eviction fails the scatter before it publishes anything (Note [A failed deferred
      // eviction reaches the work]).
      if (work)
        if (std::exception_ptr error = work->end()) std::rethrow_exception(error);
      TiledInternals::install_tiles(*fresh, tiles);  // valid, dirty, version advanced once
      claim->end();
      TensorPtr result = make_tensor(fresh, templ->offset, templ->layout);
      if (record) {
        auto node = std::make_shared<ScatterNode>();
        node->name = "scatter";
        node->dispatch_kind = &c->kind();
        node->carrier = c;
        node->selection = sel;
        node->add = add;
        // The scatter node saves `compact`, as the public contract says (docs/guide.md, "TiledEvictable",
        // Scatter): a backward after it was written in place raises "modified in-place" with both versions, like
        // any saved tensor. Its VJP reads no value of it (unlike Note [A projection saves no values], the contract
        // decides here): the check tells a user that the values the result was built from are gone.
        node->save(compact);
        if (compact->is_differentiable()) {
          node->inputs.push_back(compact);
          node->compact_input = true;
        }
        if (templ->is_differentiable()) {
          node->inputs.push_back(templ);
          node->template_input = true;
        }
        attach_node(node, result);
      }
      done->set_value(std::move(result));
    } catch (...) {
      std::exception_ptr error = std::current_exception();
      if (work) error = work->end(error);  // a second end (after a failed deferred eviction) returns `error` as is
      claim->end();
      done->set_error(std::move(error));
    }
  };
  Executor::select().submit(std::move(job));
  return done;
}

}  // namespace sw
