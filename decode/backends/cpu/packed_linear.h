// One linear of the native decoder, whatever its weight's kind: a PackedWeight (fp32 panels, int4 codes for fp32 or
// int8 activations, int8 rows), checked once when Python builds it, and y = x W^T (+ bias) through it
// (packed_linear.cpp: fp32 panels run kernels.cpp's product, the rest quantized_tiles.h's).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace polyspec {

// One weight in a kernel's layout (Python builds it by name: PackedWeight(words=..., ...)): fp32 panels [P, K, 8]
// (pack.cpp's `pack`; no scales), or quantized: int4 words [P, K] int32/int64 (fp32 activations), or for int8
// activations int4 bytes [P, K / 8, kLanes * 4] uint8 or int8 rows [P, K / 4, kLanes * 4] int8, scales
// [P, G, kLanes]; inputs in `perm` order (none: as they come), groups of inputs [bounds[g], bounds[g + 1]) sharing
// a scale; n outputs, the bias added after the chain.
struct PackedWeight {
  torch::Tensor words, scales, bounds, perm, bias;  // scales, bounds (fp32), perm, bias: undefined when none
  int64_t n;

  // The bytes a product reads from it: every part, whole.
  int64_t nbytes() const {
    int64_t total = 0;
    for (const auto* t : {&words, &scales, &bounds, &perm, &bias}) total += t->defined() ? t->nbytes() : 0;
    return total;
  }
};

// Rows of x [M, K] -> int8 codes, one scale and the sum of the codes per row and block of kA8Block inputs.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
};

struct Scratch {  // per forward: inputs gathered into act order, quantized inputs
  std::vector<float> gathered;
  QuantizedRows rows;
};

PackedWeight packed_weight(const torch::Tensor& words, int64_t n, const c10::optional<torch::Tensor>& scales,
                           const c10::optional<torch::Tensor>& bounds, const c10::optional<torch::Tensor>& perm,
                           const c10::optional<torch::Tensor>& bias);
void packed_linear(const float* x, int64_t M, const PackedWeight& w, float* y, int64_t ldy, Scratch& scratch);
torch::Tensor packed_mm(const torch::Tensor& x, const PackedWeight& w);

}  // namespace polyspec
