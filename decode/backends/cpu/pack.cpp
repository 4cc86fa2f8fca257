// The packers of pack.h: each weight once, from PyTorch tensors into the panels the products stream.
#include "pack.h"

namespace polyspec {

// W [N, K] -> panels [ceil(N / 8), K, 8], the last one zero-padded.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat, "pack: a 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// codes [N, K] (0..15, inputs in their kernel order), scales [N, G] -> (words [P, K], scales [P, G, kLanes]),
// P = ceil(N / kLanes), padded outputs with code 8 and scale 0.
std::vector<torch::Tensor> pack_int4(const torch::Tensor& codes, const torch::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && codes.size(0) == scales.size(0),
              "pack_int4: codes [N, K], scales [N, G]");
  const int64_t n = codes.size(0), k = codes.size(1), g = scales.size(1), panels = (n + kLanes - 1) / kLanes;
  auto c = codes.to(torch::kLong).contiguous();
  auto s = scales.to(torch::kFloat).contiguous();
  auto words = torch::zeros({panels, k}, torch::kLong);
  auto packed_scales = torch::zeros({panels, g, kLanes}, torch::kFloat);
  auto wp = words.data_ptr<int64_t>();
  auto sp = packed_scales.data_ptr<float>();
  const int64_t* cp = c.data_ptr<int64_t>();
  const float* ssrc = s.data_ptr<float>();
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const int64_t col = p * kLanes + lane;
      const int64_t shift = kLanes == 16 ? (lane % 2) * 32 + (lane / 2) * 4 : lane * 4;
      for (int64_t i = 0; i < k; ++i) wp[p * k + i] |= static_cast<int64_t>(col < n ? cp[col * k + i] : 8) << shift;
      for (int64_t j = 0; j < g && col < n; ++j) sp[(p * g + j) * kLanes + lane] = ssrc[col * g + j];
    }
  return {kLanes == 16 ? words : words.to(torch::kInt), packed_scales};
}

// codes [N, K] (0..15, kernel order), scales [N, G] -> (bytes [P, K / 8, kLanes * 4] uint8, scales [P, G, kLanes]):
// per panel, per 8 inputs, kLanes x 4 bytes, byte (lane, i) holding input i's code in its low nibble and input
// 4 + i's in its high one.
std::vector<torch::Tensor> pack_int4_a8(const torch::Tensor& codes, const torch::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % kA8Block == 0, "pack_int4_a8: codes [N, K] with K a multiple of 16");
  const int64_t n = codes.size(0), k = codes.size(1), panels = (n + kLanes - 1) / kLanes;
  auto c = torch::full({panels * kLanes, k}, 8, torch::kByte);
  c.narrow(0, 0, n).copy_(codes.to(torch::kByte));
  // [P, lanes, K / 8, 2, 4] -> [P, K / 8, lanes, 4, 2]: (low, high) nibbles of each byte side by side
  auto grouped = c.view({panels, kLanes, k / kNibbleStep, 2, 4}).permute({0, 2, 1, 4, 3}).contiguous();
  auto bytes = grouped.select(4, 0).bitwise_or(grouped.select(4, 1).bitwise_left_shift(4));
  bytes = bytes.reshape({panels, k / kNibbleStep, kLanes * 4});
  auto s = torch::zeros({panels * kLanes, scales.size(1)}, torch::kFloat);
  s.narrow(0, 0, n).copy_(scales.to(torch::kFloat));
  return {bytes.contiguous(), s.view({panels, kLanes, scales.size(1)}).transpose(1, 2).contiguous()};
}

// q [N, K] int8 (-127..127), scales [N] -> (bytes [P, K / 4, kLanes * 4] int8, byte (lane, i) holding input i's
// weight + kByteZero, scales [P, 1, kLanes]), padded outputs 0.
std::vector<torch::Tensor> pack_int8(const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && scales.numel() == q.size(0) &&
              q.size(1) % kA8Block == 0,
              "pack_int8: q [N, K] int8 with K a multiple of 16, scales [N]");
  const int64_t n = q.size(0), k = q.size(1), panels = (n + kLanes - 1) / kLanes;
  auto padded = torch::zeros({panels * kLanes, k}, torch::kInt);
  padded.narrow(0, 0, n).copy_(q);
  padded.add_(kByteZero);  // two's complement bytes of w + 128: the unsigned bytes VNNI reads
  auto bytes = padded.to(torch::kByte).view({panels, kLanes, k / kByteStep, 4}).permute({0, 2, 1, 3}).contiguous();
  bytes = bytes.view(torch::kChar);
  auto s = torch::zeros({panels * kLanes}, torch::kFloat);
  s.narrow(0, 0, n).copy_(scales.reshape(-1));
  return {bytes.reshape({panels, k / kByteStep, kLanes * 4}), s.view({panels, 1, kLanes})};
}

}  // namespace polyspec
