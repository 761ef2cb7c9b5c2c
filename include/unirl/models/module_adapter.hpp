#pragma once
/// \file module_adapter.hpp
/// `module_adapter` implements `TrainableModule` for any cloneable `torch::nn` module holder, so a
/// model adapter only adds what its track needs (a forward for logits, a velocity, an action).
///
/// ```cpp
/// struct my_model : unirl::models::module_adapter<my_model, MyNet> {
///   using track = my_track;
///   using module_adapter::module_adapter;
/// };
/// ```
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/core/error.hpp>
#include <unirl/models/lora.hpp>

namespace unirl::models {

namespace detail {
inline named_tensors to_named(const torch::OrderedDict<std::string, torch::Tensor>& d, const std::string& prefix) {
  named_tensors out;
  out.reserve(d.size());
  for (const auto& item : d) out.emplace_back(prefix + item.key(), item.value());
  return out;
}
}  // namespace detail

/// CRTP base: `Derived` is the adapter, `Net` a `torch::nn::ModuleHolder` of a `Cloneable` module.
template <class Derived, class Net>
class module_adapter {
 public:
  explicit module_adapter(Net net) : net_(std::move(net)) {}

  Net& net() { return net_; }
  const Net& net() const { return net_; }

  std::vector<torch::Tensor> parameters() const { return net_->parameters(); }
  named_tensors named_parameters() const { return detail::to_named(net_->named_parameters(), ""); }
  named_tensors named_buffers() const { return detail::to_named(net_->named_buffers(), ""); }
  void train(bool on) { net_->train(on); }
  void to(torch::Device device) { net_->to(device); }
  torch::Device device() const {
    const auto ps = net_->parameters();
    return ps.empty() ? torch::Device(torch::kCPU) : ps.front().device();
  }

  /// A deep copy: same weights, independent storage (reference model, EMA copy). LoRA adapters
  /// are copied with the rest, and so is each parameter's requires_grad when there are some.
  Derived clone() const {
    Derived copy = static_cast<const Derived&>(*this);
    const auto dev = device();
    auto cloned = std::dynamic_pointer_cast<typename Net::Impl>(lora::clone(*net_.ptr(), dev));
    UNIRL_CHECK(cloned != nullptr, "module_adapter::clone: the module is not a torch::nn::Cloneable");
    copy.net_ = Net(cloned);
    return copy;
  }

 protected:
  Net net_;
};

}  // namespace unirl::models
