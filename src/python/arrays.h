// NumPy <-> libtorch for the Python module. Arrays come in as float32/float64 (integers and bools
// for index arguments) and go back as NumPy arrays; torch tensors are converted by the Python
// package (python/kvx/__init__.py), zero-copy on the CPU.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

namespace kvx::python {

namespace py = pybind11;

// A copy of `a` as a tensor: integers int64, bools bool (index arguments such as routes).
torch::Tensor to_tensor(const py::array& a);
// A copy of `a` as a float operand: float64 stays float64 when keep_double, anything else
// (other floats, integers, bools) becomes float32; keep_double false: always float32 (the f32 kernels).
torch::Tensor to_float(const py::array& a, bool keep_double = true);
py::array to_array(const torch::Tensor& t);  // a NumPy copy (float32/float64/int64/bool)

// Shape checks that name the argument: rank, and sizes (-1: any).
void require_shape(const torch::Tensor& t, const std::string& name, const std::vector<int64_t>& sizes,
                   const std::string& layout);

// JSON <-> Python objects (through Python's json module).
py::object to_python(const nlohmann::json& j);
nlohmann::json to_json(const py::handle& o);

}  // namespace kvx::python
