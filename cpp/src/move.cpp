#include "strideweave/move.hpp"

#include <map>
#include <mutex>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"

namespace sw {

namespace {
std::mutex g_routes_mutex;
// Intentionally leaked: routes may hold language-binding objects that must not be destroyed at exit.
auto& g_routes = *new std::map<std::pair<const CarrierKind*, const CarrierKind*>, std::shared_ptr<TransferRoute>>();
// Function-local: safe to use from other translation units' initialisers.
std::mutex& hook_mutex() {
  static std::mutex m;
  return m;
}
MoveNodeHook& hook_slot() {
  static auto* h = new MoveNodeHook();  // intentionally leaked
  return *h;
}

// The shipped carriers: every pair of them has a built-in bulk route. Evictable
// reads and writes its resident primary through read_slots/write_slots (a move
// from or into an evicted Evictable fails with its RuntimeError).
bool is_native_storage(const CarrierKind* k) {
  return k == &generic_kind() || k == &cpu_kind() || k == &file_backed_kind() || k == &block_device_carrier_kind() ||
         k == &evictable_kind();
}

std::shared_ptr<TransferRoute> find_route(const CarrierKind* s, const CarrierKind* d) {
  std::lock_guard lock(g_routes_mutex);
  auto it = g_routes.find({s, d});
  return it == g_routes.end() ? nullptr : it->second;
}

enum class RouteKind { Builtin, Registered, Fallback };

// The message names both exact classes as "Source, Destination".
std::string no_route(const CarrierKind* s, const CarrierKind* d, const std::string& unsupported) {
  std::string m = detail::concat("move: no route from ", s->name, " to ", d->name, " (the class pair ", s->name, ", ",
                         d->name, " has no built-in or registered route and no element-wise fallback");
  if (!unsupported.empty()) m += detail::concat("; the registered route is unsupported: ", unsupported);
  return m + ")";
}

// Note [Moves own before they prepare]: a move claims its source and its
// destination as soon as its checks pass, before a registered route's
// provider prepares, so that nothing can write or release either carrier
// while a slow prepare runs (and so fail the move later, after the caller
// was told it was accepted). The provider itself does write the in-flight
// destination: while the engine calls its prepare, its submit and its
// completion's wait, the calling thread may write the destination through
// the public API (Carrier::TransferWrites). A failed or unsupported prepare
// ends the claims before the error is raised, so the carriers are as before.
}  // namespace

void register_route(const CarrierKind* source, const CarrierKind* destination,
                    std::shared_ptr<TransferRoute> route) {
  std::lock_guard lock(g_routes_mutex);
  if (!g_routes.emplace(std::make_pair(source, destination), std::move(route)).second)
    raise<ValueError>("a route from ", source->name, " to ", destination->name, " is already registered");
}

bool has_route(const CarrierKind* s, const CarrierKind* d, bool sf, bool df) {
  if (is_native_storage(s) && is_native_storage(d)) return true;
  if (find_route(s, d)) return true;
  return sf && df;
}

void set_move_node_hook(MoveNodeHook hook) {
  std::lock_guard lock(hook_mutex());
  hook_slot() = std::move(hook);
}

CompletionPtr<TensorPtr> move_async(const TensorPtr& tensor, const CarrierPtr& destination) {
  if (!tensor) raise<TypeError>("move: tensor must be a Tensor");
  const CarrierPtr& source = tensor->carrier;
  // 2. source released or owned
  if (source->is_released()) raise<RuntimeError>("move: the source ", source->kind_name(), " carrier is released");
  if (source->is_owned())
    raise<RuntimeError>("move: the source ", source->kind_name(), " carrier is owned by ", source->owner_description(),
                        "; wait for that work before moving it");
  // 3. destination type
  if (!destination) raise<TypeError>("move: destination must be a Carrier instance");
  // 4. own carrier
  if (destination == source) raise<ValueError>("move: the destination is the tensor's own carrier");
  // 5. destination state
  if (destination->is_released()) raise<RuntimeError>("move: the destination ", destination->kind_name(), " carrier is released");
  if (!destination->is_mutable())
    raise<RuntimeError>("move: the destination ", destination->kind_name(), " carrier is not publicly mutable",
                        destination->is_owned() ? " (it is owned by another request)" : "");
  // 6. dtype
  if (destination->dtype() != tensor->dtype())
    raise<TypeError>("move: dtype mismatch: the tensor is ", tensor->dtype().name(), " but the destination ",
                     destination->kind_name(), " carrier is ", destination->dtype().name());
  // 7. extent
  const int64_t need = tensor->layout.cosize();
  const bool grow = destination->size() < need;
  if (grow && !destination->is_allocatable())
    raise<ValueError>("move: the destination ", destination->kind_name(), " carrier has ", destination->size(),
                      " slots but the layout needs ", need, " and it is not allocatable");
  // 8. route
  const CarrierKind* sk = &source->kind();
  const CarrierKind* dk = &destination->kind();
  const bool fallback = source->allows_elementwise_fallback() && destination->allows_elementwise_fallback() &&
                        !sk->dependent && !dk->dependent;
  std::shared_ptr<TransferRoute> route;
  const bool builtin = is_native_storage(sk) && is_native_storage(dk);
  if (!builtin) route = find_route(sk, dk);
  if (!builtin && !route && !fallback) raise<NotImplementedError>(no_route(sk, dk, ""));
  const bool record = is_grad_enabled() && tensor->is_differentiable();
  if (record) {
    bool reverse = has_route(dk, sk, destination->allows_elementwise_fallback() && !dk->dependent,
                             source->allows_elementwise_fallback() && !sk->dependent);
    if (!reverse)
      raise<NotImplementedError>("move: grad mode is on and the tensor is differentiable, but there is no reverse route from ",
                                 dk->name, " to ", sk->name, " for its gradient");
  }

  // The request is accepted: both carriers are owned from here until the move
  // is terminal, the provider's prepare included (Note [Moves own before they
  // prepare]).
  auto claims = std::make_shared<std::pair<Carrier::Claim, Carrier::Claim>>(source->claim("a move"),
                                                                              destination->claim("a move"));
  RouteKind route_kind = builtin ? RouteKind::Builtin : RouteKind::Fallback;
  TransferRoute::Submit submit;
  if (route) {
    std::string unsupported;
    TransferRequest request{tensor, destination, sk, dk, &tensor->dtype(), tensor->layout, need};
    {
      Carrier::TransferWrites writes(*destination);
      submit = route->prepare(request, unsupported);  // a provider exception ends the claims and propagates
    }
    if (submit) route_kind = RouteKind::Registered;
    else if (!fallback) raise<NotImplementedError>(no_route(sk, dk, unsupported));
  }
  auto done = std::make_shared<Completion<TensorPtr>>();
  TransferRoute::Waiter waiter;
  if (route_kind == RouteKind::Registered) {
    try {
      if (grow) destination->grow(need, true);
      Carrier::TransferWrites writes(*destination);
      waiter = submit();
    } catch (...) {
      submit = nullptr;
      claims.reset();
      done->set_error(std::current_exception());
      return done;
    }
  }
  // Both claims are held until the move is terminal: the source's ends in the
  // same step that releases it, the destination's just before the result is
  // published (so a waiter never sees it still owned).
  using Claims = std::shared_ptr<std::pair<Carrier::Claim, Carrier::Claim>>;
  // The result over the filled destination; the claims are ended on return and on failure alike.
  auto finish = [record](const TensorPtr& tensor, const CarrierPtr& destination, Claims& claims) {
    try {
      TensorPtr result = make_tensor(destination, 0, tensor->layout);
      destination->bump_version();
      tensor->carrier->release_claimed(claims->first);
      if (record) {
        MoveNodeHook hook;
        {
          std::lock_guard lock(hook_mutex());
          hook = hook_slot();
        }
        if (hook) hook(tensor, result);
      }
      claims.reset();
      return result;
    } catch (...) {
      claims.reset();
      throw;
    }
  };
  // The prepared transfer (held by `submit`) and its completion (held by `waiter`) live in the job until the
  // move is terminal, whoever else lets go of them.
  Executor::moves().submit([tensor = TensorPtr(tensor), destination = CarrierPtr(destination), route_kind,
                            submit = std::move(submit), waiter = std::move(waiter), grow, need,
                            claims = std::move(claims), done, finish]() mutable {
    TensorPtr result;
    std::exception_ptr error;
    try {
      const Carrier& src = *tensor->carrier;
      switch (route_kind) {
        case RouteKind::Builtin:
          destination->check_storage_intact("move into it");  // Note [Files changed under a carrier]
          if (grow) destination->grow(need, !tensor->layout.is_contiguous());
          for (const Run& r : tensor->layout.runs())
            copy_slots(src, tensor->offset + r.offset, *destination, r.offset, r.length);
          break;
        case RouteKind::Registered:
          if (waiter) {
            Carrier::TransferWrites writes(*destination);
            waiter();
          }
          break;
        case RouteKind::Fallback: {
          destination->check_storage_intact("move into it");
          if (grow) destination->grow(need, true);
          const FlatLayout& flat = tensor->layout.flat();
          const int64_t n = tensor->layout.size();
          for (int64_t i = 0; i < n; ++i) {
            int64_t off = flat.index(i);
            destination->write_value(off, src.read_value(tensor->offset + off));
          }
          break;
        }
      }
      result = finish(tensor, destination, claims);
    } catch (...) {
      claims.reset();
      error = std::current_exception();
    }
    // Note [Letting go before completing] (tiled/residency.cpp): whoever waits may next count the references to
    // the source or the destination, or expect a consumed source's storage to be gone; so the job drops its own
    // before the completion is set, not when the executor destroys it.
    tensor.reset();
    destination.reset();
    waiter = nullptr;
    submit = nullptr;
    if (error) done->set_error(std::move(error));
    else done->set_value(std::move(result));
  });
  return done;
}

}  // namespace sw
