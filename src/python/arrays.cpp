#include "python/arrays.h"

#include <cstring>

#include "nn/tensor_io.h"
#include "util/error.h"

namespace kvx::python {

using namespace pybind11::literals;

namespace {

template <class T>
torch::Tensor copy_array(const py::array& a, torch::ScalarType type) {
  auto c = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!c) throw Error("could not read an array of shape " + std::to_string(a.ndim()) + "-d as " + torch::toString(type));
  std::vector<int64_t> shape(c.shape(), c.shape() + c.ndim());
  auto t = torch::empty(shape, type);
  if (c.size() > 0) std::memcpy(t.data_ptr(), c.data(), c.size() * sizeof(T));
  return t;
}

template <class T>
py::array copy_tensor(const torch::Tensor& t) {
  const auto c = t.contiguous();
  std::vector<py::ssize_t> shape(c.sizes().begin(), c.sizes().end());
  py::array_t<T> a(shape);
  if (c.numel() > 0) std::memcpy(a.mutable_data(), c.data_ptr(), c.numel() * sizeof(T));
  return std::move(a);
}

}  // namespace

torch::Tensor to_tensor(const py::array& a) {
  const char kind = a.dtype().kind();
  if (kind == 'f') return to_float(a);
  if (kind == 'i' || kind == 'u') return copy_array<int64_t>(a, torch::kInt64);
  if (kind == 'b') return copy_array<bool>(a, torch::kBool);
  throw Error("expected a numeric array (floats, integers or bools), got dtype kind '" + std::string(1, kind) + "'");
}

torch::Tensor to_float(const py::array& a, bool keep_double) {
  const char kind = a.dtype().kind();
  if (kind != 'f' && kind != 'i' && kind != 'u' && kind != 'b')
    throw Error("expected a numeric array, got dtype kind '" + std::string(1, kind) + "'");
  if (keep_double && kind == 'f' && a.dtype().itemsize() == 8) return copy_array<double>(a, torch::kFloat64);
  return copy_array<float>(a, torch::kFloat32);
}

py::array to_array(const torch::Tensor& t) {
  const auto c = t.detach().cpu();
  switch (c.scalar_type()) {
    case torch::kFloat64: return copy_tensor<double>(c);
    case torch::kInt64: return copy_tensor<int64_t>(c);
    case torch::kBool: return copy_tensor<bool>(c);
    case torch::kFloat32: return copy_tensor<float>(c);
    default: return copy_tensor<float>(c.to(torch::kFloat32));
  }
}

void require_shape(const torch::Tensor& t, const std::string& name, const std::vector<int64_t>& sizes,
                   const std::string& layout) {
  bool ok = t.dim() == static_cast<int64_t>(sizes.size());
  for (size_t i = 0; ok && i < sizes.size(); ++i) ok = sizes[i] < 0 || t.size(static_cast<int64_t>(i)) == sizes[i];
  if (!ok) throw Error(name + " must be " + layout + ", got shape " + nn::shape_of(t));
}

py::object to_python(const nlohmann::json& j) { return py::module_::import("json").attr("loads")(j.dump()); }

nlohmann::json to_json(const py::handle& o) {
  if (o.is_none()) return nlohmann::json::object();
  std::string text;
  try {
    text = py::module_::import("json").attr("dumps")(o, "allow_nan"_a = false).cast<std::string>();
  } catch (const py::error_already_set& e) {  // NaN/inf, or objects JSON has no form for
    throw Error("the settings are not JSON (" + std::string(e.what()) + "); give numbers, strings, lists and dicts, "
                "and finite numbers only");
  }
  return nlohmann::json::parse(text);
}

}  // namespace kvx::python
