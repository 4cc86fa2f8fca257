// Weight packing: the layouts the products read, and the packers that write them (pack.cpp), once per weight.
// fp32 weights go into 8-column panels (kernels.cpp's product); 4-bit codes into panels of kLanes outputs (the
// build's vector width, simd.h), for fp32 activations as one word of nibbles per input, for int8 activations as bytes
// holding two inputs' codes; int8 rows (an LM head) into panels of bytes. Padded outputs get code 8 (int4) or 0
// (int8) and scale 0.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace polyspec {

constexpr int64_t kPanel = 8;     // output columns per panel of the fp32 product: one AVX2 register
constexpr int64_t kA8Block = 16;  // inputs per activation scale of the int8-activation products (whole weight groups)
constexpr int64_t kNibbleStep = 8;  // inputs per kLanes x 4 bytes of int4 codes for int8 activations
constexpr int64_t kByteStep = 4;    // inputs per kLanes x 4 bytes of int8 weights
constexpr int32_t kByteZero = kLanes == 16 ? 128 : 0;  // added to an int8 weight's byte: VNNI reads unsigned bytes
// The codes of one panel at one input, for fp32 activations: kLanes nibbles (AVX-512: even lanes in the low half).
using Code = std::conditional_t<kLanes == 16, uint64_t, uint32_t>;

torch::Tensor pack(const torch::Tensor& weight);
std::vector<torch::Tensor> pack_int4(const torch::Tensor& codes, const torch::Tensor& scales);
std::vector<torch::Tensor> pack_int4_a8(const torch::Tensor& codes, const torch::Tensor& scales);
std::vector<torch::Tensor> pack_int8(const torch::Tensor& q, const torch::Tensor& scales);

}  // namespace polyspec
