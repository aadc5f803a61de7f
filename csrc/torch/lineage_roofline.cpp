// The C++ recorder's roofline floor on a recorded op's cost: what
// python/membudget/lineage.py's _modelled_seconds computes with costs.py
// (roofline_seconds over op_flops and op_bytes), without Python on the
// forward path. See Note [Roofline floor on CUDA].
//
// Note [Roofline floor on CUDA]: on an asynchronous device the CPU timer
// around an op sees its launch, not its kernel, so a replay priced by the
// timer alone looks almost free and the director would drop where it should
// swap. Both recorders therefore take, for a CUDA install, the larger of the
// measured time and the device model's roofline (launch overhead plus the
// larger of FLOPs over the FLOP rate of the output's dtype and bytes moved
// over memory bandwidth). FLOPs follow torch.utils.flop_counter's formulas
// for matmuls, convolutions and attention (2 per multiply-add) and count one
// per output element otherwise; bytes are every tensor argument and output.
// tests/test_lineage_native.py checks this against costs.py on the same ops.
#include <numeric>
#include <string>

#include "torch/lineage_recorder.h"

namespace membudget {
namespace lineage {
namespace {

double nbytes(const at::Tensor& t) {
  // A wrapped number is a Python scalar argument (x * 2.0), which costs.py
  // sees as a number: no memory traffic.
  if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return 0.0;
  return static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
}

template <typename Visit>
void for_each_tensor(const std::vector<c10::IValue>& values, Visit visit) {
  for (const c10::IValue& value : values) {
    if (value.isTensor()) {
      visit(value.toTensor());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorList().vec()) visit(t);
    } else if (value.isList()) {
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor()) visit(item.toTensor());
      }
    }
  }
}

const at::Tensor* tensor_at(const std::vector<c10::IValue>& values, size_t position) {
  if (position >= values.size() || !values[position].isTensor()) return nullptr;
  const at::Tensor& t = values[position].toTensor();
  return t.defined() ? &t : nullptr;
}

// "aten::addmm.default" -> "addmm"
std::string base_name(const std::string& name) {
  const size_t start = name.find("::");
  const size_t begin = start == std::string::npos ? 0 : start + 2;
  const size_t end = name.find('.', begin);
  return name.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// flop_counter's formula for this op, or a negative number when it has none.
double formula_flops(const std::string& op, const std::vector<c10::IValue>& in,
                     const std::vector<c10::IValue>& out) {
  auto dims = [](const at::Tensor* t) { return t == nullptr ? std::vector<int64_t>{} : t->sizes().vec(); };
  if (op == "mm" || op == "addmm") {
    const size_t first = op == "mm" ? 0 : 1;
    std::vector<int64_t> a = dims(tensor_at(in, first)), b = dims(tensor_at(in, first + 1));
    if (a.size() != 2 || b.size() != 2) return -1;
    return 2.0 * a[0] * a[1] * b[1];
  }
  if (op == "bmm" || op == "baddbmm") {
    const size_t first = op == "bmm" ? 0 : 1;
    std::vector<int64_t> a = dims(tensor_at(in, first)), b = dims(tensor_at(in, first + 1));
    if (a.size() != 3 || b.size() != 3) return -1;
    return 2.0 * a[0] * a[1] * a[2] * b[2];
  }
  if (op == "convolution" || op == "_convolution" || op == "cudnn_convolution" ||
      op == "convolution_overrideable") {
    std::vector<int64_t> x = dims(tensor_at(in, 0)), w = dims(tensor_at(in, 1)), y = dims(tensor_at(out, 0));
    if (x.size() < 3 || w.size() != x.size() || y.size() != x.size()) return -1;
    // convolution's `transposed` argument: position 6 (convolution, _convolution)
    bool transposed = false;
    if ((op == "convolution" || op == "_convolution" || op == "convolution_overrideable") && in.size() > 6 &&
        in[6].isBool()) {
      transposed = in[6].toBool();
    }
    const std::vector<int64_t>& spatial = transposed ? x : y;
    double flops = 2.0 * static_cast<double>(x[0]);
    for (int64_t d : w) flops *= static_cast<double>(d);
    for (size_t i = 2; i < spatial.size(); ++i) flops *= static_cast<double>(spatial[i]);
    return flops;
  }
  if (op == "_scaled_dot_product_efficient_attention" || op == "_scaled_dot_product_flash_attention" ||
      op == "_scaled_dot_product_cudnn_attention") {
    std::vector<int64_t> q = dims(tensor_at(in, 0)), k = dims(tensor_at(in, 1)), v = dims(tensor_at(in, 2));
    if (q.size() != 4 || k.size() != 4 || v.size() != 4) return -1;
    const double heads = static_cast<double>(q[0]) * static_cast<double>(q[1]);
    return 2.0 * heads * q[2] * q[3] * k[2] + 2.0 * heads * q[2] * k[2] * v[3];
  }
  return -1;
}

}  // namespace

double RooflineModel::flop_rate(at::ScalarType dtype) const {
  switch (dtype) {
    case at::ScalarType::BFloat16:
      return bf16_flops_per_s;
    case at::ScalarType::Half:
      return fp16_flops_per_s;
    case at::ScalarType::Double:
      return fp64_flops_per_s;
    default:
      break;
  }
  if (dtype != at::ScalarType::Undefined && !at::isFloatingType(dtype) && !at::isComplexType(dtype)) {
    return int_flops_per_s;
  }
  return fp32_flops_per_s;
}

double roofline_seconds(const RooflineModel& model, const OpInfo& info, const std::vector<c10::IValue>& inputs,
                        const std::vector<c10::IValue>& outputs) {
  double bytes = 0.0;
  for_each_tensor(inputs, [&](const at::Tensor& t) { bytes += nbytes(t); });
  double elements = 0.0;
  for_each_tensor(outputs, [&](const at::Tensor& t) {
    bytes += nbytes(t);
    if (t.defined()) elements += static_cast<double>(t.numel());
  });
  double flops = formula_flops(base_name(info.name), inputs, outputs);
  if (flops < 0) flops = elements;
  // costs.py rates by the output's dtype when the op returns one tensor.
  at::ScalarType dtype = at::ScalarType::Undefined;
  if (outputs.size() == 1 && outputs[0].isTensor() && outputs[0].toTensor().defined()) {
    dtype = outputs[0].toTensor().scalar_type();
  }
  return model.launch_s + std::max(flops / model.flop_rate(dtype), bytes / model.memory_bytes_per_s);
}

}  // namespace lineage
}  // namespace membudget
