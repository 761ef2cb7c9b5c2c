// trainer::save(path, extras...) stores each extra in the checkpoint; an extra without
// save(OutputArchive&) const / load(InputArchive&) is rejected with a message naming Checkpointable.
#include <cstdint>
#include <string>

#include <unirl/trainer.hpp>

#include "common/bandit.hpp"

// A counter that can travel in a checkpoint.
struct counter_state {
  std::int64_t n = 0;
  void save(torch::serialize::OutputArchive& a) const { unirl::train::write_scalar(a, "n", n); }
  void load(torch::serialize::InputArchive& a) { n = unirl::train::read_scalar<std::int64_t>(a, "n"); }
};
static_assert(unirl::Checkpointable<counter_state>);

// The same counter without save / load.
struct plain_state {
  std::int64_t n = 0;
};

using bandit_trainer = unirl::trainer<bandit::model, bandit::policy_gradient, bandit::correct_label>;

void save_with_extra(const bandit_trainer& t, const std::string& path) {
#if defined(UNIRL_FAILTEST_KO)
  plain_state s;
#else
  counter_state s;
#endif
  t.save(path, s);
}
