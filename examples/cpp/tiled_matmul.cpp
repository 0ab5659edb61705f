// tiled_matmul: the engine from C++, without Python (examples/cpp/README.md).
//
// Expert weights stay in a raw checkpoint file that a TiledEvictable opens in place as its secondary tier (the
// expert-last layout of docs/guide.md, "Mixture-of-Experts weights in a file"). Two experts are promoted and
// projected into one dense (out, 2 * in) matrix; activations x (tokens, 2 * in) times its transpose give
// y = x[:, :in] W_a^T + x[:, in:] W_b^T; backward of sum(y) fills x.grad and the weights' tiled gradient.
// Every value is checked against a double-precision reference computed here; any mismatch prints its reason
// and exits with status 1.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "strideweave/autograd.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/ops.hpp"
#include "strideweave/tiled/data.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace {

constexpr int64_t kExperts = 6, kOut = 24, kIn = 16, kTokens = 5;
constexpr int64_t kA = 4, kB = 1;  // the two experts used, in projection order

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok && failures++ < 10) std::fprintf(stderr, "MISMATCH: %s\n", what.c_str());
}

void check_close(double got, double want, const std::string& what) {
  const double tol = 1e-4 * (1.0 + std::fabs(want));
  check(std::fabs(got - want) <= tol,
        what + ": got " + std::to_string(got) + ", expected " + std::to_string(want));
}

double value_of(const sw::TensorPtr& t, int64_t i, int64_t j) {
  return t->get(sw::IntTuple::tuple({i, j})).f;
}

}  // namespace

int main() {
  // Deterministic weights W[e](o, k) and activations x(t, k), exactly representable in float.
  auto weight = [](int64_t e, int64_t o, int64_t k) { return static_cast<double>((e * 7 + o * 3 + k * 5) % 17 - 8) / 8.0; };
  auto activation = [](int64_t t, int64_t k) { return static_cast<double>((t * 11 + k * 2) % 13 - 6) / 4.0; };

  // The checkpoint: each expert's (out, in) matrix column-major, one expert after another.
  const std::filesystem::path path = std::filesystem::temp_directory_path() /
                                     ("strideweave-example-" + std::to_string(::getpid()) + ".f32");
  {
    std::vector<float> file(static_cast<size_t>(kExperts * kOut * kIn));
    for (int64_t e = 0; e < kExperts; ++e)
      for (int64_t k = 0; k < kIn; ++k)
        for (int64_t o = 0; o < kOut; ++o)
          file[static_cast<size_t>(o + kOut * (k + kIn * e))] = static_cast<float>(weight(e, o, k));
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(file.data()),
                                                static_cast<std::streamsize>(file.size() * sizeof(float)));
  }
  struct RemoveFile {
    std::filesystem::path p;
    ~RemoveFile() { std::filesystem::remove(p); }
  } remove_file{path};

  const sw::DType& f32 = sw::DType::Float32();
  // The file itself, read-only, is the secondary tier; the primary tier starts empty (every tile in the file).
  auto secondary = std::make_shared<sw::FileBackedCarrier>(path.string(), f32, /*is_mutable=*/false);
  auto primary = std::make_shared<sw::CPUCarrier>(0, f32, /*is_mutable=*/true, /*empty=*/true);
  auto weights = std::make_shared<sw::TiledEvictable>(primary, secondary, std::vector<int64_t>{1, kExperts},
                                                      std::vector<int64_t>{kOut, kIn}, /*policy=*/nullptr);
  // The full weight tensor (out, in * E), column-major: expert e is tile (0, e), one contiguous range of the file.
  sw::TensorPtr full = sw::make_tensor(weights, 0, sw::column_major(sw::Shape::flat({kOut, kIn * kExperts})));

  // Residency: promote both experts (one read each), then evict one again (clean: nothing is written).
  const std::vector<int64_t> tiles{weights->tile_index({0, kA}), weights->tile_index({0, kB})};
  weights->promote_async(tiles)->value();
  weights->evict_async({tiles[1]})->value();
  check(weights->tile_state({0, kA}).location == sw::TileLocation::Primary, "expert A resident after promote");
  check(weights->tile_state({0, kB}).location == sw::TileLocation::Secondary, "expert B in the file after evict");

  // The projection: experts A then B as one dense (out, 2 * in) matrix; B is promoted as part of the request.
  sw::TensorPtr w = sw::project(weights, full, sw::TileSelection{{{0}, {kA, kB}}}, nullptr)->value();
  check(w->size() == kOut * 2 * kIn, "projection size");
  for (int64_t o = 0; o < kOut; ++o)
    for (int64_t k = 0; k < 2 * kIn; ++k)
      check_close(value_of(w, o, k), weight(k < kIn ? kA : kB, o, k % kIn),
                  "projection (" + std::to_string(o) + ", " + std::to_string(k) + ")");

  // Activations (tokens, 2 * in) on the CPU tier, a differentiable leaf.
  auto xc = std::make_shared<sw::CPUCarrier>(kTokens * 2 * kIn, f32, true, false);
  sw::TensorPtr x = sw::make_tensor(xc, 0, sw::column_major(sw::Shape::flat({kTokens, 2 * kIn})));
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t k = 0; k < 2 * kIn; ++k) x->set(sw::IntTuple::tuple({t, k}), sw::Value::from_float(activation(t, k)));

  // y = x w^T (matmul contracts mode 1 of both operands), loss = sum(y), then backward.
  const sw::Operand mm[] = {sw::Operand::of(x), sw::Operand::of(w)};
  sw::TensorPtr y = sw::call_op(sw::OpId::Matmul, mm);
  sw::OpOptions all;
  all.description = "a b ->";
  const sw::Operand rs[] = {sw::Operand::of(y)};
  sw::TensorPtr loss = sw::call_op(sw::OpId::ReduceSum, rs, all);
  sw::backward(loss, nullptr, /*retain_graph=*/false);

  // The double reference.
  double loss_ref = 0.0;
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t o = 0; o < kOut; ++o) {
      double acc = 0.0;
      for (int64_t k = 0; k < 2 * kIn; ++k) acc += activation(t, k) * weight(k < kIn ? kA : kB, o, k % kIn);
      check_close(value_of(y, t, o), acc, "y(" + std::to_string(t) + ", " + std::to_string(o) + ")");
      loss_ref += acc;
    }
  check_close(loss->get(sw::IntTuple(int64_t{0})).f, loss_ref, "loss");

  // d loss / d x(t, k) = sum_o w(o, k).
  check(x->grad != nullptr, "x.grad after backward");
  if (x->grad)
    for (int64_t t = 0; t < kTokens; ++t)
      for (int64_t k = 0; k < 2 * kIn; ++k) {
        double want = 0.0;
        for (int64_t o = 0; o < kOut; ++o) want += weight(k < kIn ? kA : kB, o, k % kIn);
        check_close(value_of(x->grad, t, k), want, "x.grad(" + std::to_string(t) + ", " + std::to_string(k) + ")");
      }

  // d loss / d W[e](o, k) = sum_t x(t, k + in * slot of e) for the two projected experts, 0 for the others
  // (tiles the projection did not select are implicit zeros: no storage).
  check(full->grad != nullptr, "full.grad after backward");
  int64_t implicit = 0;
  if (full->grad) {
    auto grad_carrier = std::dynamic_pointer_cast<sw::TiledEvictable>(full->grad->carrier);
    check(grad_carrier != nullptr, "the weights' gradient is a TiledEvictable");
    for (int64_t e = 0; e < kExperts; ++e) {
      if (grad_carrier && grad_carrier->tile_state({0, e}).location == sw::TileLocation::Implicit) ++implicit;
      const int64_t slot = e == kA ? 0 : e == kB ? 1 : -1;
      for (int64_t o = 0; o < kOut; ++o)
        for (int64_t k = 0; k < kIn; ++k) {
          double want = 0.0;
          if (slot >= 0)
            for (int64_t t = 0; t < kTokens; ++t) want += activation(t, k + kIn * slot);
          check_close(value_of(full->grad, o, k + kIn * e), want,
                      "W.grad expert " + std::to_string(e) + " (" + std::to_string(o) + ", " + std::to_string(k) + ")");
        }
    }
    check(implicit == kExperts - 2, "unselected experts' gradient tiles are implicit zeros (" +
                                        std::to_string(implicit) + " of " + std::to_string(kExperts - 2) + ")");
  }

  const sw::TiledStats stats = weights->stats();
  if (failures) {
    std::fprintf(stderr, "tiled_matmul: %d mismatches against the double reference\n", failures);
    return 1;
  }
  std::printf("tiled_matmul: %lld experts of (%lld, %lld) in %s; projected experts %lld and %lld, "
              "y (%lld, %lld), loss %.4f; %lld promotions (%lld bytes), %lld evictions; "
              "x.grad and W.grad match the double reference (%lld gradient tiles implicit zero)\n",
              (long long)kExperts, (long long)kOut, (long long)kIn, path.filename().c_str(), (long long)kA,
              (long long)kB, (long long)kTokens, (long long)kOut, loss_ref, (long long)stats.promotions,
              (long long)stats.bytes_promoted, (long long)stats.evictions, (long long)implicit);
  weights->release();
  return 0;
}
