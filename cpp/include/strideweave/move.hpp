// strideweave/move.hpp — moving a tensor's values to another carrier.
//
// move_async(tensor, destination) checks, in this order and before any work:
//   source released or owned -> RuntimeError; destination missing -> TypeError
//   ("Carrier instance"); destination is the source's carrier -> ValueError
//   ("own carrier"); destination released or not publicly mutable ->
//   RuntimeError; dtype mismatch -> TypeError; destination smaller than
//   layout.cosize() and not allocatable -> ValueError; no route between the
//   two exact kinds -> NotImplementedError naming them as "Source, Destination"
//   (and, when grad mode is on and the source is differentiable, no reverse
//   route -> NotImplementedError).
// Then both carriers are claimed until the move is terminal, before a
// registered route's provider prepares (Note [Moves own before they prepare]
// in move.cpp); the prepared transfer and its completion live until then too. Success
// publishes Tensor(destination, 0, layout), advances the destination's version
// once and releases the source carrier; failure ends the claims and leaves the
// source live and unchanged.
//
// Routes resolve by exact kind pair: built-in pairs between shipped carriers
// (Generic, CPU, FileBacked, BlockDeviceCarrier, Evictable; bulk copies, one
// read/write per contiguous run), then registered
// routes, then element-by-element fallback where both carriers allow it.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "strideweave/completion.hpp"
#include "strideweave/tensor.hpp"

namespace sw {

struct TransferRequest {
  TensorPtr tensor;
  CarrierPtr destination;
  const CarrierKind* source_kind;
  const CarrierKind* destination_kind;
  const DType* dtype;
  Layout layout;
  int64_t physical_span;  // physical slots the transfer covers: the layout's cosize (from the tensor's offset)
};

// A registered route (user-defined kinds). `prepare` runs on the caller's
// thread once both carriers are claimed; it returns a submit function or sets
// `unsupported`.
// The submit function is called exactly once, after ownership is taken; it
// returns a waiter (run on a worker thread; throws on failure) or nullptr
// when the transfer completed synchronously.
class TransferRoute {
 public:
  virtual ~TransferRoute() = default;
  using Waiter = std::function<void()>;
  using Submit = std::function<Waiter()>;
  virtual Submit prepare(const TransferRequest& request, std::string& unsupported) = 0;
};

void register_route(const CarrierKind* source, const CarrierKind* destination,
                    std::shared_ptr<TransferRoute> route);
bool has_route(const CarrierKind* source, const CarrierKind* destination, bool source_fallback,
               bool destination_fallback);

// Called on success when grad mode is on and the source is differentiable
// (installed by the autograd engine).
using MoveNodeHook = std::function<void(const TensorPtr& source, const TensorPtr& result)>;
void set_move_node_hook(MoveNodeHook hook);

CompletionPtr<TensorPtr> move_async(const TensorPtr& tensor, const CarrierPtr& destination);
inline TensorPtr move_to(const TensorPtr& tensor, const CarrierPtr& destination) {
  return move_async(tensor, destination)->value();
}

}  // namespace sw
