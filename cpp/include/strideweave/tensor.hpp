// strideweave/tensor.hpp — TensorImpl: a view of a carrier.
//
// A tensor never owns data: it references `carrier` from physical `offset`,
// placed by `layout` (logical ordinal/coordinate -> offset + layout(key)).
// Tensors are shared (std::shared_ptr<TensorImpl>); the Python object for an
// impl is unique while it lives, so identity is observable from Python.
//
// Autograd slots (`grad`, `node`, `retains_grad`) are filled by the autograd
// engine; a tensor is differentiable exactly when its dtype is a storage float (Float32, BFloat16, Float16).
//
// Thread-safety: the view (carrier, offset, layout) is immutable; the grad
// slots are guarded by `mutex`.
#pragma once

#include <memory>
#include <mutex>

#include "strideweave/carrier.hpp"
#include "strideweave/layout.hpp"

namespace sw {

struct Node;  // autograd node (autograd.hpp)
struct TensorImpl;
using TensorPtr = std::shared_ptr<TensorImpl>;

struct TensorImpl : std::enable_shared_from_this<TensorImpl> {
  // Validates: offset >= 0 and offset + layout.cosize() <= carrier.size() (ValueError).
  TensorImpl(CarrierPtr carrier, int64_t offset, Layout layout);

  const CarrierPtr carrier;
  const int64_t offset;
  const Layout layout;

  const DType& dtype() const { return carrier->dtype(); }
  int64_t size() const { return layout.size(); }
  uint64_t version() const { return carrier->version(); }
  bool is_differentiable() const { return dtype().is_storage() && dtype().is_floating(); }
  bool is_mutable() const { return carrier->is_mutable(); }

  // Checked element access by ordinal or coordinate.
  Value get(const Coord& key) const;
  void set(const Coord& key, const Value& value);
  int64_t slot_of(const Coord& key) const { return offset + layout.index(key); }

  // The layout's contiguous runs, shifted by `offset`.
  std::vector<Run> physical_runs() const;
  // Dense and contiguous from `offset` (ordinal i at offset + i).
  bool is_dense() const { return layout.is_contiguous(); }

  mutable std::mutex mutex;
  TensorPtr grad;
  std::shared_ptr<Node> node;
  bool retains_grad = false;
};

TensorPtr make_tensor(CarrierPtr carrier, int64_t offset, Layout layout);

}  // namespace sw
