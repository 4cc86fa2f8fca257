// The entry points of the fp32 kernels (kernels.cpp): the packed fp32 product, attention and the read-bandwidth
// probe. Built on first use by decode/backends/cpu/kernels.py into two extensions: alone with their Python module
// (kernels_module.cpp; AVX2 + FMA) and inside the native decoder (decoder_module.cpp; AVX-512 where the CPU has it).
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace polyspec {

// A weight packed by `pack` (pack.h): [P, K, 8] fp32 panels (the last zero-padded) of n outputs.
struct DensePanels {
  const float* data;
  int64_t inputs, count, n;
};

void dense_linear(const float* x, int64_t M, const DensePanels& w, float* y, int64_t ldy);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                     const c10::optional<torch::Tensor>& bias);
double stream_sum(const torch::Tensor& data);

// One operand of `attend_views`: [B, heads, rows, columns] at `data` with these element strides.
struct Strided {
  const void* data;  // null: no operand (a mask that is not there)
  int64_t batch, head, row, column;
};

// What `attend_views` reads (q [B, Hq, T, D], k and v [B, Hkv, L, D], unit stride in D; an optional mask, bool or
// additive float, as [B, Hq, T, L]) and where it writes (out: [B, T, Hq, D], contiguous).
struct Attention {
  Strided q, k, v, mask;
  bool mask_is_bool;
  float* out;
  int64_t B, Hq, Hkv, T, L, D;
  float softcap = 0.f;  // > 0: every score s becomes softcap * tanh(s / softcap) before the mask (Gemma 2)
};

// The shapes `attend_views` can take (it trusts them): head dims a multiple of 8 up to 256, query heads a multiple of
// K/V heads; a clear error otherwise.
void check_heads(int64_t head_dim, int64_t heads, int64_t kv_heads);

// `a`'s mask operand from a mask broadcastable to [a.B, a.Hq, a.T, a.L] (none: no operand); `expanded` keeps the view
// it points into alive.
void set_mask(Attention& a, const c10::optional<torch::Tensor>& mask, torch::Tensor& expanded);
void attend_views(const Attention& a, double scale, bool causal);
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const c10::optional<torch::Tensor>& mask, double scale, bool causal, double softcap = 0.0);

}  // namespace polyspec
