// The extension module: one Python module for every C++ CPU kernel (kernels/cpu/__init__.py
// builds it).

#include <torch/extension.h>

void register_quant(pybind11::module& m);
void register_quant_x16(pybind11::module& m);
void register_kquant_x16(pybind11::module& m);
void register_ops(pybind11::module& m);
void register_decode_model(pybind11::module& m);
void register_fp8(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_quant(m);
  register_quant_x16(m);
  register_kquant_x16(m);
  register_ops(m);
  register_decode_model(m);
  register_fp8(m);
}
