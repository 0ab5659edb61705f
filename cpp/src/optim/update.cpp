// One update of a tile's values (optim_internal.hpp): torch's scalars for this step, then the element kernels of
// update_kernels.cpp over pieces that stay in cache, 16-bit weights and gradients widened and the weight rounded
// back once.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../ops/half.hpp"
#include "../ops/strided.hpp"
#include "optim_internal.hpp"
#include "quantized_state.hpp"
#include "update_kernels.hpp"

namespace sw::optim::detail {

namespace {

SgdCoefficients sgd_coefficients(const Hyperparameters& h, bool first) {
  SgdCoefficients c;
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.momentum = static_cast<float>(h.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  c.neg_lr = static_cast<float>(-h.lr);
  c.nesterov = h.nesterov;
  c.first = first;
  return c;
}

// torch's scalars: computed in double (Python floats: `1 - beta1 ** step`, `lr / bias_correction1`,
// `bias_correction2 ** 0.5` with the C library's pow, as CPython's float power), each rounded to Float32 where it
// meets a Float32 tensor.
AdamCoefficients adam_coefficients(const Hyperparameters& h, Algorithm a, int64_t step) {
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  const double step_size = h.lr / bias_correction1;
  AdamCoefficients c;
  c.decoupled = a == Algorithm::AdamW && h.weight_decay != 0.0;
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.weight_decay = a == Algorithm::Adam ? static_cast<float>(h.weight_decay) : 0.0f;
  c.lerp_weight = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-step_size);
  return c;
}

// n values of `src` (dtype d, 16-bit) widened to Float32 (exact).
void widen(DTypeId d, const void* src, float* out, int64_t n) {
  if (d == DTypeId::BFloat16) sw::detail::bf16_to_f32(static_cast<const uint16_t*>(src), out, n);
  else sw::detail::f16_to_f32(static_cast<const uint16_t*>(src), out, n);
}

// The update over 8-bit block-wise state (Note [Compact optimizer state]): s1 and s2 are packed tiles of n values
// (quantized_state.hpp). Pieces of whole blocks: the state decoded to Float32, the Float32 update as for Float32
// state, the new state encoded (s1: the momentum buffer or exp_avg, signed map; s2: exp_avg_sq, unsigned map).
void update_blockwise(Algorithm a, const SgdCoefficients& sgd, const AdamCoefficients& adam, void* w, DTypeId wd,
                      const void* g, DTypeId gd, void* s1, void* s2, int64_t n) {
  constexpr int64_t kChunk = 2048;  // 8 blocks
  static_assert(kChunk % kQuantBlock == 0);
  const int64_t wsize = wd == DTypeId::Float32 ? 4 : 2, gsize = gd == DTypeId::Float32 ? 4 : 2;
  const int64_t blocks = quant_blocks(n);
  // Split over the cores at block boundaries (a part of 128 blocks or more: 32768 values, as the other states).
  sw::detail::parallel_for(blocks, 128, [&](int64_t bb, int64_t be) {
    float wb[kChunk], gb[kChunk], b1[kChunk], b2[kChunk];
    const int64_t e = std::min(n, be * kQuantBlock);
    for (int64_t at = bb * kQuantBlock; at < e; at += kChunk) {
      const int64_t len = std::min(kChunk, e - at);
      void* wat = static_cast<std::byte*>(w) + at * wsize;
      const void* gat = static_cast<const std::byte*>(g) + at * gsize;
      float* wp = wd == DTypeId::Float32 ? static_cast<float*>(wat) : wb;
      if (wd != DTypeId::Float32) widen(wd, wat, wb, len);
      const float* gp = gd == DTypeId::Float32 ? static_cast<const float*>(gat) : gb;
      if (gd != DTypeId::Float32) widen(gd, gat, gb, len);
      // SGD's first step sets the buffer from the gradient without reading it.
      if (s1 && !(a == Algorithm::SGD && sgd.first)) dequantize_blocks(s1, n, at, len, b1, true);
      if (s2) dequantize_blocks(s2, n, at, len, b2, false);
      if (a == Algorithm::SGD) sgd_update(wp, gp, s1 ? b1 : nullptr, len, sgd);
      else adam_update(wp, gp, b1, b2, len, adam);
      if (s1) quantize_blocks(b1, s1, n, at, len, true);
      if (s2) quantize_blocks(b2, s2, n, at, len, false);
      if (wd == DTypeId::BFloat16) sw::detail::f32_to_bf16(wb, static_cast<uint16_t*>(wat), len);
      else if (wd == DTypeId::Float16) sw::detail::f32_to_f16(wb, static_cast<uint16_t*>(wat), len);
    }
  });
}

}  // namespace

void update(Algorithm a, const Hyperparameters& h, int64_t step, bool first, void* w, DTypeId wd, const void* g,
            DTypeId gd, void* s1, void* s2, StateDType sd, int64_t n) {
  const SgdCoefficients sgd = sgd_coefficients(h, first);
  const AdamCoefficients adam = adam_coefficients(h, a, step);
  constexpr int64_t kChunk = 2048;  // 8 KiB of Float32 per operand: the pieces stay in L1/L2
  const int64_t wsize = wd == DTypeId::Float32 ? 4 : 2, gsize = gd == DTypeId::Float32 ? 4 : 2;
  if (sd == StateDType::Int8Blockwise) return update_blockwise(a, sgd, adam, w, wd, g, gd, s1, s2, n);
  const bool bf16_state = sd == StateDType::BFloat16;
  const int64_t ssize = bf16_state ? 2 : 4;
  // Bound by memory bandwidth: a large tile (an expert's megabytes) is split over the cores.
  sw::detail::parallel_for(n, int64_t{1} << 15, [&](int64_t b, int64_t e) {
    float wb[kChunk], gb[kChunk], b1[kChunk], b2[kChunk];
    for (int64_t at = b; at < e; at += kChunk) {
      const int64_t len = std::min(kChunk, e - at);
      void* wat = static_cast<std::byte*>(w) + at * wsize;
      const void* gat = static_cast<const std::byte*>(g) + at * gsize;
      float* wp = wd == DTypeId::Float32 ? static_cast<float*>(wat) : wb;
      if (wd != DTypeId::Float32) widen(wd, wat, wb, len);
      const float* gp = gd == DTypeId::Float32 ? static_cast<const float*>(gat) : gb;
      if (gd != DTypeId::Float32) widen(gd, gat, gb, len);
      // The state: in place when Float32; BFloat16 widened into b1/b2 (exact) and rounded back once below.
      void* s1at = s1 ? static_cast<std::byte*>(s1) + at * ssize : nullptr;
      void* s2at = s2 ? static_cast<std::byte*>(s2) + at * ssize : nullptr;
      float* p1 = !s1at ? nullptr : bf16_state ? b1 : static_cast<float*>(s1at);
      float* p2 = !s2at ? nullptr : bf16_state ? b2 : static_cast<float*>(s2at);
      if (bf16_state) {
        // SGD's first step sets the buffer from the gradient without reading it (its tile may hold anything).
        if (s1at && !(a == Algorithm::SGD && first)) widen(DTypeId::BFloat16, s1at, b1, len);
        if (s2at) widen(DTypeId::BFloat16, s2at, b2, len);
      }
      if (a == Algorithm::SGD) sgd_update(wp, gp, p1, len, sgd);
      else adam_update(wp, gp, p1, p2, len, adam);
      if (bf16_state) {
        if (s1at) sw::detail::f32_to_bf16(b1, static_cast<uint16_t*>(s1at), len);
        if (s2at) sw::detail::f32_to_bf16(b2, static_cast<uint16_t*>(s2at), len);
      }
      if (wd == DTypeId::BFloat16) sw::detail::f32_to_bf16(wb, static_cast<uint16_t*>(wat), len);
      else if (wd == DTypeId::Float16) sw::detail::f32_to_f16(wb, static_cast<uint16_t*>(wat), len);
    }
  });
}

}  // namespace sw::optim::detail
