// Optimizer::save_state and load_state (Note [Optimizer state files] in strideweave/optim.hpp): the state tensors as
// tile-major views written by sw::safetensors::save, the step counts and hyperparameters as JSON metadata; a load
// checks the whole file first, then reads each state tile's byte range into the tile held resident under the budget.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "strideweave/carriers/native.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"
#include "strideweave/optim.hpp"
#include "../tiled/internal.hpp"
#include "optim_internal.hpp"
#include "quantized_state.hpp"

namespace sw::optim {

namespace {

using json = nlohmann::json;
constexpr const char* kFormat = "strideweave.optim.state/1";

// The tile grid and tile shape of a slot's parameter (a dense one: one tile of all its slots).
std::vector<int64_t> grid_of(const TensorPtr& p, const std::shared_ptr<TiledEvictable>& t) {
  return t ? t->grid_shape() : std::vector<int64_t>{1};
}
std::vector<int64_t> tile_of(const TensorPtr& p, const std::shared_ptr<TiledEvictable>& t) {
  return t ? t->tile_shape() : std::vector<int64_t>{p->layout.cosize()};
}

// The state tensor `state` read tile-major: shape ((grid), (tile)), element (t, w) the slot of within-tile
// ordinal w of tile t (both colex, first axis fastest, as TileGeometry numbers them), so its row-major order (what
// a save writes) is tile after tile, each in within-tile order. A dense state: ((1), (n)) over its n slots.
TensorPtr tile_major(const TensorPtr& state, const std::shared_ptr<TiledEvictable>& tiled) {
  if (!tiled) {
    const int64_t n = state->layout.cosize();
    return make_tensor(state->carrier, 0,
                       Layout(Shape(IntTuple::tuple({IntTuple::tuple({1}), IntTuple::tuple({n})})),
                              Stride(IntTuple::tuple({IntTuple::tuple({0}), IntTuple::tuple({1})}))));
  }
  const auto& g = tiled->grid_shape();
  const auto& t = tiled->tile_shape();
  std::vector<IntTuple> gs, gd, ts, td;
  int64_t prefix = 1;
  for (size_t a = 0; a < g.size(); ++a) {
    gs.emplace_back(g[a]);
    gd.emplace_back(t[a] * prefix);
    ts.emplace_back(t[a]);
    td.emplace_back(prefix);
    prefix *= g[a] * t[a];
  }
  return make_tensor(state->carrier, 0,
                     Layout(Shape(IntTuple::tuple({IntTuple::tuple(gs), IntTuple::tuple(ts)})),
                            Stride(IntTuple::tuple({IntTuple::tuple(gd), IntTuple::tuple(td)}))));
}

// The rows of a packed 8-bit state tensor (Note [Compact optimizer state]): shape (tiles, m) over its m slots per
// tile, tile after tile (the state carrier's slots in order).
TensorPtr packed_rows(const TensorPtr& state, int64_t tiles, int64_t m) {
  return make_tensor(state->carrier, 0,
                     Layout(Shape(IntTuple::tuple({IntTuple(tiles), IntTuple(m)})),
                            Stride(IntTuple::tuple({IntTuple(m), IntTuple(1)}))));
}

std::vector<std::string> state_names(Algorithm a) {
  if (a == Algorithm::SGD) return {"momentum_buffer"};
  return {"exp_avg", "exp_avg_sq"};
}

json hyper_json(const Hyperparameters& h) {
  return json{{"lr", h.lr}, {"momentum", h.momentum}, {"dampening", h.dampening}, {"nesterov", h.nesterov},
              {"beta1", h.beta1}, {"beta2", h.beta2}, {"eps", h.eps}, {"weight_decay", h.weight_decay}};
}

}  // namespace

void Optimizer::save_state(const std::string& path) const {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<std::string, TensorPtr>> tensors;
  std::map<std::string, std::string> meta;
  meta["format"] = json(kFormat).dump();
  meta["algorithm"] = json(algorithm_name(algorithm_)).dump();
  meta["state_dtype"] = json(state_dtype_name(state_dtype_)).dump();
  meta["hyperparameters"] = hyper_json(h_).dump();
  meta["params"] = json(slots_.size()).dump();
  const std::vector<std::string> names = state_names(algorithm_);
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Slot& s = *slots_[k];
    const std::string prefix = "param" + std::to_string(k);
    std::vector<int> stateful(s.stateful.begin(), s.stateful.end());
    meta[prefix] = json{{"shape", s.param->layout.shape().str()}, {"grid", grid_of(s.param, s.tiled)},
                        {"tile", tile_of(s.param, s.tiled)}, {"step", s.steps}, {"state_tiles", stateful}}
                       .dump();
    const TensorPtr states[2] = {s.state1, s.state2};
    const bool packed = state_dtype_ == StateDType::Int8Blockwise;
    const int64_t tiles = static_cast<int64_t>(s.steps.size());
    const int64_t m = detail::quant_tile_slots(s.tiled ? s.tiled->tile_size() : s.param->layout.cosize());
    for (size_t j = 0; j < names.size(); ++j)
      if (states[j])
        tensors.emplace_back(prefix + "." + names[j],
                             packed ? packed_rows(states[j], tiles, m) : tile_major(states[j], s.tiled));
  }
  safetensors::save(path, tensors, meta);
}

void Optimizer::load_state(const std::string& path) {
  std::lock_guard lock(mutex_);
  const char* name = algorithm_name(algorithm_);
  const safetensors::Header header = safetensors::read_header(path);  // ValueError for a malformed file
  auto meta = [&](const std::string& key) -> json {
    auto it = header.metadata.find(key);
    if (it == header.metadata.end())
      raise<ValueError>(name, ".load_state: ", path, " is not an optimizer state file: its metadata has no '", key,
                        "'");
    json j = json::parse(it->second, nullptr, false);
    if (j.is_discarded())
      raise<ValueError>(name, ".load_state: ", path, ": metadata '", key, "' is not JSON: ", it->second);
    return j;
  };
  auto bad = [&](const std::string& key, const auto&... what) {
    raise<ValueError>(name, ".load_state: ", path, ": metadata '", key, "' ", what...);
  };
  if (meta("format") != json(kFormat))
    bad("format", "is ", header.metadata.at("format"), ", not \"", kFormat, "\"");
  const json algorithm = meta("algorithm");
  if (algorithm != json(name))
    raise<ValueError>(name, ".load_state: ", path, " holds the state of ", algorithm.dump(), ", not of ", name);
  // The state dtype (Note [Compact optimizer state]); a file written before it was recorded holds Float32 state.
  {
    const std::string want = state_dtype_name(state_dtype_);
    const json sd = header.metadata.count("state_dtype") ? meta("state_dtype") : json("Float32");
    if (sd != json(want))
      raise<ValueError>(name, ".load_state: ", path, " holds state of state_dtype ", sd.dump(), "; this ", name,
                        " stores its state as ", want, " (build it with that state_dtype to load this file)");
  }
  const json count = meta("params");
  if (!count.is_number_unsigned() || count.get<uint64_t>() != slots_.size())
    raise<ValueError>(name, ".load_state: ", path, " holds the state of ", count.dump(), " parameters; this ",
                      name, " has ", slots_.size());
  Hyperparameters h;
  {
    const json hj = meta("hyperparameters");
    auto number = [&](const char* key) -> double {
      if (!hj.is_object() || !hj.contains(key) || !hj[key].is_number()) bad("hyperparameters", "has no number ", key);
      return hj[key].get<double>();
    };
    h.lr = number("lr");
    h.momentum = number("momentum");
    h.dampening = number("dampening");
    h.beta1 = number("beta1");
    h.beta2 = number("beta2");
    h.eps = number("eps");
    h.weight_decay = number("weight_decay");
    if (!hj.contains("nesterov") || !hj["nesterov"].is_boolean()) bad("hyperparameters", "has no boolean nesterov");
    h.nesterov = hj["nesterov"].get<bool>();
    validate(algorithm_, h);
  }
  // Per parameter: its geometry, counts and state tensors, all checked before anything changes.
  struct Plan {
    std::vector<int64_t> steps;
    std::vector<uint8_t> stateful;
    std::vector<const safetensors::TensorInfo*> tensors;  // per state name; null: absent (SGD without buffers)
  };
  const std::vector<std::string> names = state_names(algorithm_);
  const char* st = state_dtype_ == StateDType::BFloat16 ? "BF16" : "F32";
  // Bytes of one stored slot, and the stored slots of a state tile of n values (packed 8-bit: the raw bytes of a
  // packed tile in Float32 slots).
  const int64_t sb = state_dtype_ == StateDType::BFloat16 ? 2 : 4;
  auto stored_slots = [&](int64_t n) {
    return state_dtype_ == StateDType::Int8Blockwise ? detail::quant_tile_slots(n) : n;
  };
  std::vector<Plan> plans(slots_.size());
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Slot& s = *slots_[k];
    const std::string key = "param" + std::to_string(k);
    const json pj = meta(key);
    if (!pj.is_object()) bad(key, "is not an object");
    const std::string shape = s.param->layout.shape().str();
    if (!pj.contains("shape") || pj["shape"] != json(shape))
      raise<ValueError>(name, ".load_state: ", path, ": parameter ", k, " has shape ",
                        pj.contains("shape") ? pj["shape"].dump() : "(none)", " in the file, ", shape, " here");
    const std::vector<int64_t> grid = grid_of(s.param, s.tiled), tile = tile_of(s.param, s.tiled);
    for (const auto& [field, want] : {std::pair{"grid", grid}, std::pair{"tile", tile}})
      if (!pj.contains(field) || pj[field] != json(want))
        raise<ValueError>(name, ".load_state: ", path, ": parameter ", k, " has tile ", field, " ",
                          pj.contains(field) ? pj[field].dump() : "(none)", " in the file, ", json(want).dump(),
                          " here");
    const size_t tiles = s.steps.size();
    Plan& plan = plans[k];
    const json& steps = pj.contains("step") ? pj["step"] : json();
    const json& stateful = pj.contains("state_tiles") ? pj["state_tiles"] : json();
    if (!steps.is_array() || steps.size() != tiles || !stateful.is_array() || stateful.size() != tiles)
      bad(key, "must hold 'step' and 'state_tiles', ", tiles, " each");
    for (size_t i = 0; i < tiles; ++i) {
      if (!steps[i].is_number_integer() || steps[i].get<int64_t>() < 0) bad(key, "has a step that is not a count");
      if (stateful[i] != json(0) && stateful[i] != json(1)) bad(key, "has a state_tiles entry that is not 0 or 1");
      plan.steps.push_back(steps[i].get<int64_t>());
      plan.stateful.push_back(static_cast<uint8_t>(stateful[i].get<int>()));
    }
    const int64_t tile_size = stored_slots(s.tiled ? s.tiled->tile_size() : s.param->layout.cosize());
    for (const std::string& n : names) {
      const std::string tname = key + "." + n;
      const safetensors::TensorInfo* info = header.find(tname);
      if (!info) {
        const bool optional = algorithm_ == Algorithm::SGD &&
                              std::all_of(plan.stateful.begin(), plan.stateful.end(), [](uint8_t b) { return !b; });
        if (!optional) raise<ValueError>(name, ".load_state: ", path, " holds no tensor '", tname, "'");
      } else if (info->dtype != st || info->shape != std::vector<int64_t>{static_cast<int64_t>(tiles), tile_size}) {
        raise<ValueError>(name, ".load_state: ", path, ": tensor '", tname, "' is ", info->dtype, " ",
                          json(info->shape).dump(), "; this parameter's state is ", st, " ",
                          json(std::vector<int64_t>{static_cast<int64_t>(tiles), tile_size}).dump());
      }
      plan.tensors.push_back(info);
    }
  }
  // Everything checked: SGD buffers the file holds and this optimizer has not are allocated first.
  if (algorithm_ == Algorithm::SGD) {
    std::vector<TensorPtr> buffers(slots_.size());
    for (size_t k = 0; k < slots_.size(); ++k)
      if (!slots_[k]->state1 && (plans[k].tensors[0] || h.momentum != 0)) buffers[k] = make_state(*slots_[k]);
    for (size_t k = 0; k < slots_.size(); ++k)
      if (buffers[k]) slots_[k]->state1 = std::move(buffers[k]);
  }
  const int fd = io::open_file(path, O_RDONLY | O_CLOEXEC);
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_fd{fd};
  for (size_t k = 0; k < slots_.size(); ++k) {
    Slot& s = *slots_[k];
    const Plan& plan = plans[k];
    const TensorPtr states[2] = {s.state1, s.state2};
    for (size_t j = 0; j < names.size(); ++j) {
      if (!states[j]) continue;
      const safetensors::TensorInfo* info = plan.tensors[j];
      if (!s.tiled) {
        const int64_t n = stored_slots(s.param->layout.cosize());
        const Carrier::Claim claim = states[j]->carrier->claim(std::string(name) + ".load_state");
        std::byte* data = states[j]->carrier->mutable_native_data();
        if (info) io::pread_full(fd, data, static_cast<size_t>(n * sb), static_cast<int64_t>(info->begin), path);
        else std::memset(data, 0, static_cast<size_t>(n * sb));
        states[j]->carrier->bump_version();
        continue;
      }
      auto& c = static_cast<TiledEvictable&>(*states[j]->carrier);
      const int64_t n = c.tile_size();  // stored slots (a packed carrier's tiles are packed tiles)
      const std::string label = std::string(name) + ".load_state";
      for (int64_t i = 0; i < c.tile_count(); ++i) {
        const bool value = info && plan.stateful[static_cast<size_t>(i)];
        if (!value && c.tile_state(c.tile_coord(i)).location == TileLocation::Implicit) continue;  // stays implicit
        auto hold = TiledInternals::hold_in_turn(c, i, label.c_str());
        if (!hold)
          raise<RuntimeError>(name, ".load_state: state tile ", coord_str(c.tile_coord(i)),
                              " could not be held: its primary tier has no host memory");
        if (value)
          io::pread_full(fd, hold->data(), static_cast<size_t>(n * sb),
                         static_cast<int64_t>(info->begin) + i * n * sb, path);
        else
          std::memset(hold->data(), 0, static_cast<size_t>(n * sb));
        hold->commit();
      }
    }
    s.steps = plan.steps;
    s.stateful = plan.stateful;
  }
  h_ = h;
}

}  // namespace sw::optim
