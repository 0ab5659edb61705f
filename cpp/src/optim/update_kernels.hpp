// optim/update_kernels.hpp — the optimizers' element updates over Float32 memory (Note [Optimizers on tiled
// parameters] in strideweave/optim.hpp): AVX-512 where the CPU has it (runtime dispatch), a portable loop otherwise;
// both compute the same values (the same operations, fused multiply-adds where torch's kernels fuse).
#pragma once

#include <cstdint>

namespace sw::optim::detail {

// SGD, torch.optim's single-tensor order: g += wd * w (fused); buf = g on a tile's first step, else
// buf = buf * momentum + (1 - dampening) * g (the product rounded, then fused); g = nesterov ? g + momentum * buf
// (fused) : buf; w += -lr * g (fused).
struct SgdCoefficients {
  float weight_decay = 0;         // 0: none
  float momentum = 0;             // 0: no buffer (buf may be null)
  float one_minus_dampening = 1;
  float neg_lr = 0;
  bool nesterov = false;
  bool first = false;             // the buffer's first step: buf = g
};

// Adam / AdamW, torch.optim's single-tensor order: w *= decay (AdamW, when weight decay is on); g += wd * w (Adam,
// fused); m = lerp(m, g, 1 - beta1) (torch's vectorised lerp: fused); v = v * beta2 (rounded), then
// v += (1 - beta2) * g * g (the first product rounded, the rest fused); w += (-step_size * m) / (sqrt(v) /
// bias_correction2_sqrt + eps) (each operation rounded, sqrt correctly rounded).
struct AdamCoefficients {
  bool decoupled = false;          // AdamW with weight decay: w *= decay first
  float decay = 1;
  float weight_decay = 0;          // Adam: coupled weight decay (0: none)
  float lerp_weight = 0.1f;        // 1 - beta1
  float beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1;
  float eps = 1e-8f;
  float neg_step_size = 0;         // -lr / (1 - beta1**step)
};

// In place over n Float32 values (w, the state) with the gradient g.
void sgd_update(float* w, const float* g, float* buf, int64_t n, const SgdCoefficients& c) noexcept;
void adam_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamCoefficients& c) noexcept;

// "avx512f" or "portable": the path the updates take on this machine. Tests force the portable one.
const char* update_kernel_path() noexcept;
void force_portable_update_kernels(bool portable) noexcept;

}  // namespace sw::optim::detail
