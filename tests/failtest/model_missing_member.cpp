// A model adapter must be a TrainableModule; one without clone() is rejected with a message
// naming TrainableModule.
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"

struct no_clone_model {
  using track = bandit::track;
  bandit::model inner{bandit::policy_net(8)};
  std::vector<torch::Tensor> parameters() const { return inner.parameters(); }
  unirl::named_tensors named_parameters() const { return inner.named_parameters(); }
  unirl::named_tensors named_buffers() const { return inner.named_buffers(); }
#if !defined(UNIRL_FAILTEST_KO)
  no_clone_model clone() const { return {inner.clone()}; }
#endif
  void train(bool on) { inner.train(on); }
  void to(torch::Device d) { inner.to(d); }
  torch::Tensor log_probs(const torch::Tensor& x) { return inner.log_probs(x); }
};

template class unirl::trainer<no_clone_model, bandit::policy_gradient, bandit::correct_label>;
