// The Python module of the native decoder (decoder.cpp, packed_linear.cpp, pack.cpp, kernels.cpp): the packers, the
// PackedWeight and its product, the read-bandwidth probe of this build, and the Decoder.
#include <torch/extension.h>

#include "decoder.h"
#include "kernels.h"
#include "pack.h"
#include "packed_linear.h"
#include "simd.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace polyspec;
  m.def("pack_int4", &pack_int4, "codes [N, K], scales [N, G] -> panel words and scales");
  m.def("pack_int8", &pack_int8, "int8 rows [N, K], scales [N] -> panel bytes and scales");
  m.def("pack_int4_a8", &pack_int4_a8, "codes [N, K], scales [N, G] -> panel bytes and scales for int8 activations");
  py::class_<PackedWeight>(m, "PackedWeight")
      .def(py::init(&packed_weight), py::arg("words"), py::arg("n"), py::arg("scales") = py::none(),
           py::arg("bounds") = py::none(), py::arg("perm") = py::none(), py::arg("bias") = py::none())
      .def_readonly("words", &PackedWeight::words)
      .def_readonly("scales", &PackedWeight::scales)
      .def_readonly("n", &PackedWeight::n)
      .def_property_readonly("nbytes", &PackedWeight::nbytes);
  m.def("packed_mm", &packed_mm, "x W^T (+ b) through a PackedWeight of either kind");
  m.def("lanes", [] { return kLanes; }, "outputs per panel (8: AVX2, 16: AVX-512)");
  m.def("stream_sum", &stream_sum, "sum of a float32 buffer streamed by all threads (bandwidth probe)");
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<torch::Tensor, const c10::optional<torch::Tensor>&, torch::Tensor, torch::Tensor, int64_t, int64_t,
                    double, int64_t>())
      .def("add_layer", &Decoder::add_layer)
      .def("head_dim", &Decoder::head_dim)
      .def("weight_bytes", &Decoder::weight_bytes)
      .def("forward", &Decoder::forward, py::arg("ids"), py::arg("positions"), py::arg("mask"), py::arg("cached"),
           py::arg("keys"), py::arg("values"), py::arg("aux") = py::none(),
           py::arg("aux_layers") = std::vector<int64_t>{})
      .def("forward_states", &Decoder::forward_states, py::arg("states"), py::arg("positions"), py::arg("mask"),
           py::arg("cached"), py::arg("keys"), py::arg("values"));
}
