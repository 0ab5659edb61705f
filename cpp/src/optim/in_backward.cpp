// Stepping in backward (Note [Stepping in backward] in strideweave/optim.hpp): the gradient hooks an optimizer
// built with step_in_backward installs on its tiled parameters, counting each tile's recorded uses
// (Note [Gradient reservations]) and stepping a tile when its last use has delivered its gradient.
#include <algorithm>

#include "strideweave/errors.hpp"
#include "../tiled/internal.hpp"
#include "optim_internal.hpp"

namespace sw::optim {

class Optimizer::InBackward final : public TileGradientHook {
 public:
  InBackward(std::shared_ptr<Link> link, size_t slot) : link_(std::move(link)), slot_(slot) {}

  void reserve(std::span<const int64_t> tiles) override {
    std::lock_guard lock(link_->m);
    Optimizer* o = link_->optimizer;
    if (!o) return;
    std::lock_guard olock(o->mutex_);
    Slot& s = *o->slots_[slot_];
    for (int64_t t : tiles)
      if (s.stepped_in_backward[static_cast<size_t>(t)])
        raise<RuntimeError>(algorithm_name(o->algorithm_), " (step_in_backward): tile ",
                            coord_str(s.tiled->tile_coord(t)), " of parameter ", slot_,
                            " was stepped in backward and step() has not run since; call step() after each backward "
                            "(and run the backwards of all micro-batches but the last under no_step())");
    for (int64_t t : tiles) s.reserved[static_cast<size_t>(t)]++;
  }

  void finish(int64_t t, bool delivered) override {
    std::lock_guard lock(link_->m);
    Optimizer* o = link_->optimizer;
    if (!o) return;
    {
      std::lock_guard olock(o->mutex_);
      int32_t& n = o->slots_[slot_]->reserved[static_cast<size_t>(t)];
      SW_ASSERT(n > 0, "a gradient reservation finished twice");
      if (--n != 0 || !delivered || o->accumulating_) return;
    }
    o->step_tile_in_backward(slot_, t);  // takes the optimizer's lock itself
  }

 private:
  std::shared_ptr<Link> link_;
  size_t slot_;
};

void Optimizer::install_hooks() {
  link_ = std::make_shared<Link>();
  link_->optimizer = this;
  size_t installed = 0;
  try {
    for (size_t k = 0; k < slots_.size(); ++k) {
      Slot& s = *slots_[k];
      if (!s.tiled) continue;
      s.reserved.assign(static_cast<size_t>(s.tiled->tile_count()), 0);
      s.stepped_in_backward.assign(s.reserved.size(), 0);
      s.hook = std::make_shared<InBackward>(link_, k);
      s.tiled->set_gradient_hook(s.hook);  // ValueError: another optimizer's
      installed = k + 1;
    }
  } catch (...) {
    for (size_t k = 0; k < installed; ++k)
      if (slots_[k]->hook) slots_[k]->tiled->set_gradient_hook(nullptr);
    link_ = nullptr;
    throw;
  }
}

void Optimizer::remove_hooks() noexcept {
  if (!link_) return;
  {
    std::lock_guard lock(link_->m);  // a hook calling into this optimizer now finishes first
    link_->optimizer = nullptr;
  }
  for (auto& s : slots_)
    if (s->hook && s->tiled->gradient_hook() == s->hook) s->tiled->set_gradient_hook(nullptr);
}

void Optimizer::set_accumulating(bool on) {
  std::lock_guard lock(mutex_);
  accumulating_ = on;
}

bool Optimizer::accumulating() const {
  std::lock_guard lock(mutex_);
  return accumulating_;
}

}  // namespace sw::optim
