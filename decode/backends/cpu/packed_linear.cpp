// The products of packed_linear.h: a PackedWeight from Python's parts, and y = x W^T (+ bias) through one, whatever
// its kind (fp32 panels: kernels.cpp's product; int4 or int8: quantized_tiles.h's tiles, inputs first gathered into
// act order and, for int8 activations, quantized row by row).
#include "packed_linear.h"

#include "kernels.h"
#include "pack.h"
#include "quantized_tiles.h"
#include "tiles.h"

namespace polyspec {

// The input width K of a packed weight (fp32 panels [P, K, 8]: K).
static int64_t input_width(const torch::Tensor& words) {
  if (words.scalar_type() == torch::kByte) return words.size(1) * A8Nibbles::kStep;
  if (words.scalar_type() == torch::kChar) return words.size(1) * A8Bytes::kStep;
  return words.size(1);
}

// y[:, :w.n] (row stride ldy) = x [M, K] W^T for an int4 or int8 weight; x is first gathered in act order if w has
// a perm.
static void quantized_linear(const float* x, int64_t M, const PackedWeight& w, float* y, int64_t ldy,
                             Scratch& scratch) {
  const int64_t K = input_width(w.words);
  const Panels panels{w.words.data_ptr(), w.scales.data_ptr<float>(), w.bounds.data_ptr<int64_t>(), K,
                      w.bounds.numel() - 1, w.words.numel() / w.words.size(0), w.words.size(0), w.n};
  if (w.perm.defined()) {
    scratch.gathered.resize(M * K);
    const int64_t* perm = w.perm.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) scratch.gathered[m * K + k] = x[m * K + perm[k]];
    x = scratch.gathered.data();
  }
  if (w.words.scalar_type() == torch::kByte || w.words.scalar_type() == torch::kChar) {
    quantize_rows(x, M, K, scratch.rows);
    if (w.words.scalar_type() == torch::kByte) {
      over_panels<A8NibbleTile, kA8Panels>(M, panels.count, 1, scratch.rows, panels, y, ldy);
    } else {
      over_panels<A8ByteTile, kA8Panels>(M, panels.count, 1, scratch.rows, panels, y, ldy);
    }
  } else {
    over_panels<NibbleTile, kTilePanels>(M, panels.count, 1, x, panels, y, ldy);
  }
}

// y[:, :w.n] (row stride ldy) = x [M, K] W^T (+ bias, after the chain) for a weight of either kind.
void packed_linear(const float* x, int64_t M, const PackedWeight& w, float* y, int64_t ldy, Scratch& scratch) {
  if (w.words.scalar_type() == torch::kFloat) {
    dense_linear(x, M, {w.words.data_ptr<float>(), input_width(w.words), w.words.size(0), w.n}, y, ldy);
  } else {
    quantized_linear(x, M, w, y, ldy, scratch);
  }
  if (w.bias.defined()) {
    const float* b = w.bias.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < w.n; ++j) y[m * ldy + j] += b[j];
  }
}

// x [M, K] float32 through one packed weight (fp32, int4 or int8): [M, n] (an LM head, and the product alone for
// tests).
torch::Tensor packed_mm(const torch::Tensor& x, const PackedWeight& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) == input_width(w.words),
              "packed_mm: x [M, K] float32");
  const auto input = x.contiguous();
  auto y = torch::empty({input.size(0), w.n}, input.options());
  Scratch scratch;
  packed_linear(input.data_ptr<float>(), input.size(0), w, y.data_ptr<float>(), w.n, scratch);
  return y;
}

// A PackedWeight from its named parts, checked once here (the tiles trust the layout): Python's only way to make one.
PackedWeight packed_weight(const torch::Tensor& words, int64_t n, const c10::optional<torch::Tensor>& scales,
                           const c10::optional<torch::Tensor>& bounds, const c10::optional<torch::Tensor>& perm,
                           const c10::optional<torch::Tensor>& bias) {
  const auto kind = words.scalar_type();
  const bool dense = kind == torch::kFloat;
  TORCH_CHECK(words.is_contiguous() && words.dim() >= 2 &&
              (dense || kind == torch::kInt || kind == torch::kLong || kind == torch::kByte || kind == torch::kChar),
              "PackedWeight: words from kernels' pack, pack_int4, pack_int4_a8 or pack_int8");
  const int64_t lanes = dense ? kPanel : kLanes;
  TORCH_CHECK(n > 0 && n <= words.size(0) * lanes, "PackedWeight: n outputs within the panels");
  TORCH_CHECK(!bias || bias->numel() == n, "PackedWeight: bias [n]");
  const auto bias_or_none = bias ? bias->to(torch::kFloat).contiguous() : torch::Tensor();
  if (dense) {
    TORCH_CHECK(words.dim() == 3 && words.size(2) == kPanel && !scales && !bounds && !perm,
                "PackedWeight: fp32 panels [P, K, 8] take no scales, bounds or perm");
    return {words, torch::Tensor(), torch::Tensor(), torch::Tensor(), bias_or_none, n};
  }
  TORCH_CHECK(scales && scales->is_contiguous() && scales->scalar_type() == torch::kFloat && scales->dim() == 3 &&
              scales->size(0) == words.size(0) && scales->size(2) == kLanes,
              "PackedWeight: scales [P, G, lanes] float32");
  TORCH_CHECK(bounds && bounds->is_contiguous() && bounds->scalar_type() == torch::kLong &&
              bounds->numel() == scales->size(1) + 1, "PackedWeight: bounds [G + 1] long");
  TORCH_CHECK(!perm || (perm->scalar_type() == torch::kLong && perm->numel() == input_width(words)),
              "PackedWeight: perm [K] long");
  return {words, *scales, *bounds, perm ? perm->contiguous() : torch::Tensor(), bias_or_none, n};
}

}  // namespace polyspec
