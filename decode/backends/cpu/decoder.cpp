// The native decoder's forward (decoder.h): embeddings, the layer loop, the final norm, keys and values appended to
// the caller's KV cache.
//
// Eager PyTorch spends much of a small model's forward outside its weights: thousands of small aten ops per forward
// (norms, rotary, cache concatenation, casts, act-order gathers). Here a forward is one call: the layers loop in C++
// over buffers allocated once per call, keys and values go into a preallocated cache (rollback is setting a length,
// done by the caller), and every linear is `packed_linear` (packed_linear.h), which takes either kind of weight: one
// layer loop for both. Attention is kernels.cpp's `attend_views` on plain pointers into the cache (row-exact, grouped
// heads read in place; a layer makes no tensors). Norms, rotary and SiLU (layers.h) work row by row: a forward of k
// tokens gives, row for row, the bits of k one-token forwards.
#include "decoder.h"

#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "layers.h"

namespace polyspec {

// Siblings that read the same input, their outputs side by side in y [M, ldy].
static void siblings(const float* x, int64_t M, const std::vector<PackedWeight>& ws, float* y, int64_t ldy,
                     Scratch& scratch) {
  int64_t offset = 0;
  for (const auto& w : ws) { packed_linear(x, M, w, y + offset, ldy, scratch); offset += w.n; }
}

static int64_t width(const std::vector<PackedWeight>& ws) {
  int64_t n = 0;
  for (const auto& w : ws) n += w.n;
  return n;
}

static torch::Tensor optional_weight(const c10::optional<torch::Tensor>& weight) {
  return weight.has_value() ? weight->contiguous() : torch::Tensor();
}

static int64_t optional_bytes(const torch::Tensor& weight) { return weight.defined() ? weight.nbytes() : 0; }

Decoder::Decoder(torch::Tensor embed, const c10::optional<torch::Tensor>& final_norm, torch::Tensor cos,
                 torch::Tensor sin, int64_t heads, int64_t kv_heads, double eps, int64_t layers)
    : embed_(embed.contiguous()), final_norm_(optional_weight(final_norm)), cos_(cos.contiguous()),
      sin_(sin.contiguous()), heads_(heads), kv_heads_(kv_heads), head_dim_(cos.size(1)), layers_wanted_(layers),
      eps_(static_cast<float>(eps)) {
  check_heads(head_dim_, heads, kv_heads);
}

void Decoder::add_layer(const c10::optional<torch::Tensor>& input_norm, torch::Tensor post_norm,
                        const std::vector<PackedWeight>& qkv, const PackedWeight& o,
                        const std::vector<PackedWeight>& gate_up, const PackedWeight& down) {
  TORCH_CHECK(static_cast<int64_t>(layers_.size()) < layers_wanted_, "add_layer: more layers than the model has");
  layers_.push_back({optional_weight(input_norm), post_norm.contiguous(), qkv, gate_up, o, down});
}

int64_t Decoder::weight_bytes() const {
  int64_t total = optional_bytes(final_norm_);
  for (const auto& layer : layers_) {
    total += optional_bytes(layer.input_norm) + layer.post_norm.nbytes() + layer.o.nbytes() + layer.down.nbytes();
    for (const auto& w : layer.qkv) total += w.nbytes();
    for (const auto& w : layer.gate_up) total += w.nbytes();
  }
  return total;
}

torch::Tensor Decoder::forward(const torch::Tensor& ids, const torch::Tensor& positions,
                               const c10::optional<torch::Tensor>& mask, int64_t cached, const torch::Tensor& keys,
                               const torch::Tensor& values, const c10::optional<torch::Tensor>& aux,
                               const std::vector<int64_t>& aux_layers) {
  auto h = embed_.index_select(0, ids.to(torch::kLong)).to(torch::kFloat).contiguous();
  return layers_forward(h, positions, mask, cached, keys, values, aux, aux_layers);
}

torch::Tensor Decoder::forward_states(const torch::Tensor& states, const torch::Tensor& positions,
                                      const c10::optional<torch::Tensor>& mask, int64_t cached,
                                      const torch::Tensor& keys, const torch::Tensor& values) {
  TORCH_CHECK(states.dim() == 2 && states.size(1) == embed_.size(1) && states.scalar_type() == torch::kFloat,
              "forward_states: float32 states [T, hidden]");
  auto h = states.clone(torch::MemoryFormat::Contiguous);  // the layers add into it in place
  return layers_forward(h, positions, mask, cached, keys, values, c10::nullopt, {});
}

torch::Tensor Decoder::layers_forward(torch::Tensor& h, const torch::Tensor& positions,
                                      const c10::optional<torch::Tensor>& mask, int64_t cached,
                                      const torch::Tensor& keys, const torch::Tensor& values,
                                      const c10::optional<torch::Tensor>& aux, const std::vector<int64_t>& aux_layers) {
  const int64_t T = h.size(0), H = embed_.size(1), L = cached + T;
  TORCH_CHECK(positions.numel() == T && positions.scalar_type() == torch::kLong && positions.is_contiguous(),
              "forward: positions must be T contiguous longs");
  TORCH_CHECK(static_cast<int64_t>(layers_.size()) == layers_wanted_, "forward: the model has not all its layers");
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == layers_wanted_ && keys.size(1) == kv_heads_ &&
              keys.size(3) == head_dim_ && keys.is_contiguous() && values.sizes() == keys.sizes() &&
              values.is_contiguous() && keys.scalar_type() == torch::kFloat,
              "forward: a float32 cache [layers, kv heads, capacity, head dim] for keys and for values");
  TORCH_CHECK(L <= keys.size(2), "forward: ", L, " positions exceed the KV cache's capacity of ", keys.size(2));
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_.size(0), "forward: position out of range");
  auto normed = torch::empty({T, H});
  auto step = torch::empty({T, H});
  Scratch scratch;
  std::vector<float> wide, attended(T * heads_ * head_dim_);
  const int64_t aux_width = H * static_cast<int64_t>(aux_layers.size());
  TORCH_CHECK(aux_layers.empty() || (aux.has_value() && aux->is_contiguous() &&
                                     aux->scalar_type() == torch::kFloat && aux->size(0) == T &&
                                     aux->size(1) == aux_width),
              "forward: aux must be float32 [T, ", aux_layers.size(), " * hidden]");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    for (size_t k = 0; k < aux_layers.size(); ++k) {
      if (aux_layers[k] == static_cast<int64_t>(i)) aux->narrow(1, k * H, H).copy_(h);
    }
    const float* input = h.data_ptr<float>();  // an identity input norm (an EAGLE head's layer) reads h itself
    if (layer.input_norm.defined()) {
      rms_norm(input, T, H, layer.input_norm.data_ptr<float>(), eps_, normed.data_ptr<float>());
      input = normed.data_ptr<float>();
    }
    attention(static_cast<int64_t>(i), {input, T, pos, cached}, mask, {keys, values}, {scratch, wide},
              attended.data());
    packed_linear(attended.data(), T, layer.o, step.data_ptr<float>(), H, scratch);
    add(step, h);
    rms_norm(h.data_ptr<float>(), T, H, layer.post_norm.data_ptr<float>(), eps_, normed.data_ptr<float>());
    mlp(layer, normed.data_ptr<float>(), T, step.data_ptr<float>(), scratch, wide);
    add(step, h);
  }
  if (!final_norm_.defined()) return h;
  rms_norm(h.data_ptr<float>(), T, H, final_norm_.data_ptr<float>(), eps_, normed.data_ptr<float>());
  return normed;
}

// q/k/v of layer i's T rows, rotary, keys and values into the cache after `cached`, attention into out [T, heads *
// head dim]. The cache [layers, kv heads, capacity, head dim] is read in place through plain pointers (attend_views):
// a layer makes no tensors.
void Decoder::attention(int64_t i, const Rows& x, const c10::optional<torch::Tensor>& mask, const Cache& cache,
                        const Buffers& buffers, float* out) {
  const Layer& layer = layers_[i];
  const int64_t D = head_dim_, Q = heads_ * D, KV = kv_heads_ * D, N = width(layer.qkv), T = x.count;
  const int64_t cap = cache.keys.size(2), L = x.cached + T;
  TORCH_CHECK(N == Q + 2 * KV, "attention: q/k/v widths do not match the heads");
  std::vector<float>& qkv = buffers.wide;
  qkv.resize(T * N);
  siblings(x.data, T, layer.qkv, qkv.data(), N, buffers.scratch);
  float* kc = cache.keys.data_ptr<float>() + i * kv_heads_ * cap * D;
  float* vc = cache.values.data_ptr<float>() + i * kv_heads_ * cap * D;
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv.data() + t * N;
    rotate(row, heads_ + kv_heads_, D, cos_.data_ptr<float>() + x.pos[t] * D, sin_.data_ptr<float>() + x.pos[t] * D);
    for (int64_t h = 0; h < kv_heads_; ++h) {
      std::copy(row + Q + h * D, row + Q + (h + 1) * D, kc + (h * cap + x.cached + t) * D);
      std::copy(row + Q + KV + h * D, row + Q + KV + (h + 1) * D, vc + (h * cap + x.cached + t) * D);
    }
  }
  Attention a{{qkv.data(), T * N, D, N, 1}, {kc, 0, cap * D, D, 1}, {vc, 0, cap * D, D, 1}, {}, false, out,
              1, heads_, kv_heads_, T, L, D};
  torch::Tensor expanded;
  set_mask(a, mask, expanded);
  attend_views(a, 1.0 / std::sqrt(static_cast<double>(D)), !mask.has_value() && T > 1);
}

// down(silu(gate(x)) * up(x)) of T rows into y [T, hidden].
void Decoder::mlp(const Layer& layer, const float* x, int64_t T, float* y, Scratch& scratch,
                  std::vector<float>& wide) {
  const int64_t N = width(layer.gate_up);
  wide.resize(T * N);
  siblings(x, T, layer.gate_up, wide.data(), N, scratch);
  silu_gate(wide.data(), T, N);  // silu(gate) * up, packed into the first N / 2 columns of each row's space
  packed_linear(wide.data(), T, layer.down, y, embed_.size(1), scratch);
}

}  // namespace polyspec
