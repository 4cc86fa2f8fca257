// The Python module of the fp32 kernels alone (kernels.cpp, pack.cpp): decode.fast's packed linears and attention.
#include <torch/extension.h>

#include "kernels.h"
#include "pack.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &polyspec::pack, "W [N, K] -> 8-column panels");
  m.def("linear", &polyspec::linear, "x W^T (+ b) through packed panels");
  m.def("stream_sum", &polyspec::stream_sum, "sum of a float32 buffer streamed by all threads (bandwidth probe)");
  m.def("attend", &polyspec::attend, "attention of query rows against K/V heads, [B, T, Hq, D] out");
}
