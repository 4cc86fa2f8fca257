// The project's CPU kernels as torch operators (polyspec::*), registered with the dispatcher: eager code calls them as
// torch.ops.polyspec.*, and a compiled forward (inductor, its C++ wrapper included) as opaque kernels, with no Python
// between operators. Their fake (shape-only) versions are decode/backends/cpu/kernels.py's.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "kernels.h"
#include "pack.h"
#include "packed_linear.h"

namespace polyspec {

// x [..., K] W^T (+ bias) through a packed weight given by its parts (packed_linear.h): [..., n].
static torch::Tensor packed_linear_op(const torch::Tensor& x, const torch::Tensor& words, int64_t n,
                                      const c10::optional<torch::Tensor>& scales,
                                      const c10::optional<torch::Tensor>& bounds,
                                      const c10::optional<torch::Tensor>& perm,
                                      const c10::optional<torch::Tensor>& bias) {
  auto shape = x.sizes().vec();
  shape.back() = n;
  return packed_mm(x.reshape({-1, x.size(-1)}), packed_weight(words, n, scales, bounds, perm, bias)).view(shape);
}

// `attend` over the first `length` keys of k and v (a one-element long tensor: a static cache's valid prefix, read
// here and never by the compiled graph, so that it is never a guard), the mask's columns cut alike.
static torch::Tensor attend_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask, double scale, bool causal,
                               const c10::optional<torch::Tensor>& length, double softcap) {
  if (!length) return attend(q, k, v, mask, scale, causal, softcap);
  const int64_t keys = length->item<int64_t>();
  TORCH_CHECK(keys > 0 && keys <= k.size(2), "attend: length within the keys");
  c10::optional<torch::Tensor> cut = mask ? c10::optional<torch::Tensor>(mask->narrow(-1, 0, keys)) : c10::nullopt;
  return attend(q, k.narrow(2, 0, keys), v.narrow(2, 0, keys), cut, scale, causal, softcap);
}

static std::tuple<torch::Tensor, torch::Tensor> pair(const std::vector<torch::Tensor>& parts) {
  return {parts[0], parts[1]};
}

TORCH_LIBRARY(polyspec, m) {
  m.def("linear(Tensor x, Tensor panels, int n, Tensor? bias=None) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor words, int n, Tensor? scales=None, Tensor? bounds=None, Tensor? perm=None, "
        "Tensor? bias=None) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal, Tensor? length=None, "
        "float softcap=0.0) -> Tensor");
  m.def("pack(Tensor weight) -> Tensor");
  m.def("pack_int4(Tensor codes, Tensor scales) -> (Tensor, Tensor)");
  m.def("pack_int4_a8(Tensor codes, Tensor scales) -> (Tensor, Tensor)");
  m.def("pack_int8(Tensor rows, Tensor scales) -> (Tensor, Tensor)");
  m.def("stream_sum(Tensor data) -> float");
  m.def("lanes() -> int");
}

TORCH_LIBRARY_IMPL(polyspec, CPU, m) {
  m.impl("linear", &linear);
  m.impl("packed_linear", &packed_linear_op);
  m.impl("attend", &attend_op);
  m.impl("pack", &pack);
  m.impl("pack_int4", [](const torch::Tensor& c, const torch::Tensor& s) { return pair(pack_int4(c, s)); });
  m.impl("pack_int4_a8", [](const torch::Tensor& c, const torch::Tensor& s) { return pair(pack_int4_a8(c, s)); });
  m.impl("pack_int8", [](const torch::Tensor& q, const torch::Tensor& s) { return pair(pack_int8(q, s)); });
  m.impl("stream_sum", &stream_sum);
}

TORCH_LIBRARY_IMPL(polyspec, CompositeExplicitAutograd, m) {
  m.impl("lanes", [] { return static_cast<int64_t>(kLanes); });
}

}  // namespace polyspec

// The operators a compiled forward calls, as C functions named the way inductor's C++ wrapper names a shim
// (aoti_torch_cpu_<op>; declared to it by kernels.py's `c_shims`): the wrapper then calls each directly, where it
// would otherwise box every argument and look the operator up by name on each call. Each records itself under the
// operator's name, as the dispatcher would, for torch.profiler (infra.timing.launches).
extern "C" {
using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::resolve_tensor_dispatch_flags;

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_linear(AtenTensorHandle x, AtenTensorHandle panels, int64_t n,
                                                       AtenTensorHandle* bias, AtenTensorHandle* ret) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("polyspec::linear", c10::ArrayRef<const c10::IValue>{});
    *ret = new_tensor_handle(polyspec::linear(resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(panels),
                                              n, resolve_tensor_dispatch_flags(bias)));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle words, int64_t n,
                                                              AtenTensorHandle* scales, AtenTensorHandle* bounds,
                                                              AtenTensorHandle* perm, AtenTensorHandle* bias,
                                                              AtenTensorHandle* ret) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("polyspec::packed_linear", c10::ArrayRef<const c10::IValue>{});
    *ret = new_tensor_handle(polyspec::packed_linear_op(
        resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(words), n,
        resolve_tensor_dispatch_flags(scales), resolve_tensor_dispatch_flags(bounds),
        resolve_tensor_dispatch_flags(perm), resolve_tensor_dispatch_flags(bias)));
  });
}

AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_attend(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                       AtenTensorHandle* mask, double scale, int32_t causal,
                                                       AtenTensorHandle* length, double softcap,
                                                       AtenTensorHandle* ret) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    RECORD_FUNCTION("polyspec::attend", c10::ArrayRef<const c10::IValue>{});
    *ret = new_tensor_handle(polyspec::attend_op(
        resolve_tensor_dispatch_flags(q), resolve_tensor_dispatch_flags(k), resolve_tensor_dispatch_flags(v),
        resolve_tensor_dispatch_flags(mask), scale, causal != 0, resolve_tensor_dispatch_flags(length), softcap));
  });
}
}
