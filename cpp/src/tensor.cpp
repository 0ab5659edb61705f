#include "strideweave/tensor.hpp"

#include "strideweave/errors.hpp"

namespace sw {

TensorImpl::TensorImpl(CarrierPtr c, int64_t off, Layout l)
    : carrier(std::move(c)), offset(off), layout(std::move(l)) {
  if (!carrier) raise<TypeError>("Tensor carrier must be a Carrier");
  if (offset < 0) raise<ValueError>("Tensor offset must be >= 0, got ", offset);
  int64_t n = carrier->size();
  // offset <= n first: offset + cosize could overflow int64 for an offset near 2**63.
  if (offset > n || layout.cosize() > n - offset)
    raise<ValueError>("Tensor offset ", offset, " + layout cosize ", layout.cosize(), " exceeds the ",
                      carrier->kind_name(), " carrier's ", n, " slots");
}

Value TensorImpl::get(const Coord& key) const {
  carrier->check_live("read a tensor element");
  return carrier->get(slot_of(key));
}

void TensorImpl::set(const Coord& key, const Value& value) {
  carrier->check_writable("write a tensor element");
  carrier->set(slot_of(key), value);
}

std::vector<Run> TensorImpl::physical_runs() const {
  std::vector<Run> runs = layout.runs();
  for (auto& r : runs) r.offset += offset;
  return runs;
}

TensorPtr make_tensor(CarrierPtr carrier, int64_t offset, Layout layout) {
  return std::make_shared<TensorImpl>(std::move(carrier), offset, std::move(layout));
}

}  // namespace sw
