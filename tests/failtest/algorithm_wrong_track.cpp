// An algorithm trains only the tracks it declares: pairing it with a model of another track is
// rejected with a message naming AlgorithmFor.
#include <unirl/trainer.hpp>

#include "common/bandit.hpp"

struct other_track {
  using rollout_type = bandit::rollout;
};

struct other_model : unirl::models::module_adapter<other_model, bandit::policy_net> {
#if defined(UNIRL_FAILTEST_KO)
  using track = other_track;
#else
  using track = bandit::track;
#endif
  using module_adapter::module_adapter;
  torch::Tensor log_probs(const torch::Tensor& x) { return torch::log_softmax(net()->forward(x), -1); }
};

template class unirl::trainer<other_model, bandit::policy_gradient, bandit::correct_label>;
