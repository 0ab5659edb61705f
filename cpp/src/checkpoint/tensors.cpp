// A checkpoint's tensors as StrideWeave tensors, where they lie in the files: one tensor over its byte range
// (Note [A checkpoint's tensors]) and many same-shape tensors, or the slabs of one, as the tiles of one full tensor
// (Note [A checkpoint's tiled tensor]), both in strideweave/checkpoint/safetensors.hpp.
#include "strideweave/carriers/native.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/errors.hpp"

namespace sw::safetensors {

namespace {

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t k = shape.size(); k-- > 0;) {
    strides[k] = s;
    s *= shape[k];
  }
  return strides;
}

void check_extents(const std::vector<int64_t>& shape, const std::string& what) {
  for (int64_t e : shape)
    if (e < 1)
      raise<ValueError>(what, " has an extent ", e, ": StrideWeave tensors have no empty modes, so it has no view");
}

TensorPtr tiled_over(std::shared_ptr<CheckpointCarrier> tier, const std::vector<int64_t>& shape, CarrierPtr primary,
                     std::shared_ptr<ResidencyPolicy> policy) {
  const int64_t tiles = static_cast<int64_t>(tier->ranges().size());
  TiledView v = tiled_view(shape, tiles);
  if (!primary) primary = std::make_shared<CPUCarrier>(0, tier->dtype(), true, false);
  auto carrier = std::make_shared<TiledEvictable>(std::move(primary), std::move(tier), v.grid, v.tile, std::move(policy));
  return make_tensor(std::move(carrier), 0, v.layout);
}

}  // namespace

TiledView tiled_view(const std::vector<int64_t>& shape, int64_t tiles) {
  if (tiles < 1) raise<ValueError>("a tiled tensor needs at least one tile, got ", tiles);
  check_extents(shape, "the tile shape");
  TiledView v;
  v.grid.assign(shape.size(), 1);
  v.grid.push_back(tiles);
  v.tile = shape;
  v.tile.push_back(1);
  std::vector<int64_t> full = shape, strides = row_major_strides(shape);
  full.push_back(tiles);
  strides.push_back(TileGeometry::product(shape));
  v.layout = Layout(Shape::flat(full), Stride::flat(strides));
  return v;
}

namespace {

// The number of slabs of `name` (shape `shape`) split along its first axis into `tiles` (std::nullopt: shape[0]).
int64_t slab_count(const std::string& name, const std::vector<int64_t>& shape, std::optional<int64_t> tiles) {
  if (shape.empty() || shape[0] < 1)
    raise<ValueError>("tensor '", name, "' has ", shape.empty() ? "rank 0" : "a first axis of extent 0",
                      ": it cannot be split into tiles along its first axis");
  if (!tiles) return shape[0];
  if (*tiles < 1) raise<ValueError>("tensor '", name, "' cannot be split into ", *tiles, " tiles: tiles must be >= 1");
  if (shape[0] % *tiles != 0)
    raise<ValueError>("tensor '", name, "' has a first axis of extent ", shape[0], ", which tiles=", *tiles,
                      " does not divide: it cannot be split into ", *tiles, " equal slabs");
  return *tiles;
}

}  // namespace

namespace {

// A quantized tensor splits into one slab per index of its first axis (Note [Quantized tensors of a checkpoint]).
void check_quantized_split(const Quantization& q, std::optional<int64_t> tiles) {
  const bool fp8 = q.format == QuantizedRange::Format::FP8;
  if (fp8 ? q.shape.size() != 3 : q.shape.size() < 3)
    raise<ValueError>("tensor '", q.data, "' (", fp8 ? "FP8" : "MXFP4", " values of rank ", q.shape.size(), ") cannot "
                      "be split along its first axis: ", fp8 ? "a stack of matrices (E, R, C) can"
                                                             : "blocks of rank 4 or more (E, R, G, 16) can");
  if (tiles && *tiles != q.shape[0])
    raise<ValueError>("tensor '", q.data, "' is quantized: it splits into one tile per index of its first axis (",
                      q.shape[0], "), not tiles=", *tiles);
}

}  // namespace

std::vector<int64_t> Checkpoint::split_shape(const std::string& name, std::optional<int64_t> tiles,
                                             const TierOptions& options) const {
  if (std::optional<Quantization> q = quantization(name, options.scales.empty() ? std::string() : options.scales[0],
                                                   options.block_rows, options.block_cols)) {
    check_quantized_split(*q, tiles);
    return std::vector<int64_t>(q->shape.begin() + 1, q->shape.end());
  }
  const std::vector<int64_t>& s = info(name).shape;
  const int64_t slabs = slab_count(name, s, tiles);
  std::vector<int64_t> shape(s.begin() + 1, s.end());
  if (s[0] / slabs > 1) shape.insert(shape.begin(), s[0] / slabs);  // a slab of one row is that row
  return shape;
}

std::shared_ptr<CheckpointCarrier> Checkpoint::split_tier(const std::string& name, CheckpointCarrier::Writes writes,
                                                          std::optional<int64_t> tiles, const TierOptions& options) {
  if (options.scales.size() > 1)
    raise<ValueError>("tensor '", name, "' is one tensor: give one scale tensor name, not ", options.scales.size());
  if (std::optional<Quantization> q = quantization(name, options.scales.empty() ? std::string() : options.scales[0],
                                                   options.block_rows, options.block_cols)) {
    const DType& d = quantized_dtype(*q, writes, options);
    check_quantized_split(*q, tiles);
    std::vector<CheckpointCarrier::Range> ranges;
    ranges.reserve(static_cast<size_t>(q->shape[0]));
    for (int64_t i = 0; i < q->shape[0]; ++i) ranges.push_back(quantized_range(*q, i, q->shape[0]));
    return std::make_shared<CheckpointCarrier>(std::move(ranges), d, writes);
  }
  const TensorInfo& t = info(name);
  const DType& d = dtype(name);
  if (options.dtype && options.dtype != &d)
    raise<TypeError>("tensor '", name, "' is ", d.name(), ", not ", options.dtype->name(), ": nothing converts "
                     "implicitly (give its own dtype, or none)");
  const int64_t slabs = slab_count(name, t.shape, tiles), slab = t.elements() / slabs;
  const auto f = file(where_.at(name), writes == CheckpointCarrier::Writes::InPlace, "make a tier over it");
  std::vector<CheckpointCarrier::Range> ranges;
  ranges.reserve(static_cast<size_t>(slabs));
  for (int64_t i = 0; i < slabs; ++i)
    ranges.push_back({f, t.begin + static_cast<uint64_t>(i * slab * t.itemsize), slab, nullptr});
  return std::make_shared<CheckpointCarrier>(std::move(ranges), d, writes);
}

TensorPtr Checkpoint::tensor(const std::string& name) {
  const TensorInfo& t = info(name);
  const DType& d = dtype(name);
  check_extents(t.shape, "tensor '" + name + "'");
  std::vector<CheckpointCarrier::Range> ranges{{file(where_.at(name), false, "make a tensor of it"), t.begin, t.elements(), nullptr}};
  auto carrier = std::make_shared<CheckpointCarrier>(std::move(ranges), d, CheckpointCarrier::Writes::Overlay);
  return make_tensor(std::move(carrier), 0, row_major(Shape::flat(t.shape)));
}

TensorPtr Checkpoint::tiled(const std::vector<std::string>& names, CarrierPtr primary,
                            std::shared_ptr<ResidencyPolicy> policy, CheckpointCarrier::Writes writes,
                            const TierOptions& options) {
  auto t = tier(names, writes, options);  // checks names, shapes and dtypes
  std::optional<Quantization> q =
      quantization(names[0], options.scales.empty() ? std::string() : options.scales[0], options.block_rows,
                   options.block_cols);
  return tiled_over(std::move(t), q ? q->shape : info(names[0]).shape, std::move(primary), std::move(policy));
}

TensorPtr Checkpoint::tiled_split(const std::string& name, CarrierPtr primary, std::shared_ptr<ResidencyPolicy> policy,
                                  CheckpointCarrier::Writes writes, std::optional<int64_t> tiles,
                                  const TierOptions& options) {
  auto t = split_tier(name, writes, tiles, options);
  return tiled_over(std::move(t), split_shape(name, tiles, options), std::move(primary), std::move(policy));
}

}  // namespace sw::safetensors
