// A Llama-family decoder, whole forward in one call (decoder.cpp), for two kinds of weights: fp32 (pack.cpp's packed
// panels: a chain's target) and GPTQ int4 (a W4 copy); its Python module is decoder_module.cpp. Built on first use by
// decode/backends/cpu/llama.py (decode.backends.cpu.kernels.build_extension).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "packed_linear.h"

namespace polyspec {

struct Layer {
  torch::Tensor input_norm, post_norm;  // input_norm undefined: the identity (an EAGLE head's layer)
  std::vector<PackedWeight> qkv, gate_up;  // one fused weight, or the siblings one by one (act orders that differ)
  PackedWeight o, down;
};

// The decoder: embeddings, layers, final norm (none: the last layer's output, as an EAGLE head's). The KV cache is
// the caller's ([layers, kv heads, capacity, head dim] for keys and for values, one per runner): `forward` appends
// after `cached` positions.
class Decoder {
 public:
  Decoder(torch::Tensor embed, const c10::optional<torch::Tensor>& final_norm, torch::Tensor cos, torch::Tensor sin,
          int64_t heads, int64_t kv_heads, double eps, int64_t layers);

  void add_layer(const c10::optional<torch::Tensor>& input_norm, torch::Tensor post_norm,
                 const std::vector<PackedWeight>& qkv, const PackedWeight& o,
                 const std::vector<PackedWeight>& gate_up, const PackedWeight& down);

  int64_t head_dim() const { return head_dim_; }

  // The bytes of the weights every forward reads whole, from the buffers it runs on: each layer's norms and packed
  // weights, the final norm (the embedding, rotary tables and KV cache are the caller's to count: a row per token).
  int64_t weight_bytes() const;

  // ids [T] long after `cached` cached positions, positions [T] long (rotary), mask: none (causal) or additive
  // float32 broadcastable to [1, heads, T, cached + T]. Returns the final-norm hidden states [T, hidden]. With
  // `aux_layers` (EAGLE-3), `aux` [T, aux_layers * hidden] float32 receives the states entering those layers.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions,
                        const c10::optional<torch::Tensor>& mask, int64_t cached, const torch::Tensor& keys,
                        const torch::Tensor& values, const c10::optional<torch::Tensor>& aux,
                        const std::vector<int64_t>& aux_layers);

  // The same on states [T, hidden] float32 instead of token ids (an EAGLE head's fc output): no embedding.
  torch::Tensor forward_states(const torch::Tensor& states, const torch::Tensor& positions,
                               const c10::optional<torch::Tensor>& mask, int64_t cached, const torch::Tensor& keys,
                               const torch::Tensor& values);

 private:
  torch::Tensor layers_forward(torch::Tensor& h, const torch::Tensor& positions,
                               const c10::optional<torch::Tensor>& mask, int64_t cached, const torch::Tensor& keys,
                               const torch::Tensor& values, const c10::optional<torch::Tensor>& aux,
                               const std::vector<int64_t>& aux_layers);
  struct Rows {  // a layer's input rows: T of them, their positions, after `cached` positions
    const float* data;
    int64_t count;
    const int64_t* pos;
    int64_t cached;
  };
  struct Cache {  // the caller's KV cache, [layers, kv heads, capacity, head dim] each
    const torch::Tensor& keys;
    const torch::Tensor& values;
  };
  struct Buffers {  // a forward's scratch: quantized inputs, q/k/v rows
    Scratch& scratch;
    std::vector<float>& wide;
  };
  void attention(int64_t i, const Rows& x, const c10::optional<torch::Tensor>& mask, const Cache& cache,
                 const Buffers& buffers, float* out);
  void mlp(const Layer& layer, const float* x, int64_t T, float* y, Scratch& scratch, std::vector<float>& wide);

  torch::Tensor embed_, final_norm_, cos_, sin_;
  int64_t heads_, kv_heads_, head_dim_, layers_wanted_;
  float eps_;
  std::vector<Layer> layers_;
};

}  // namespace polyspec
