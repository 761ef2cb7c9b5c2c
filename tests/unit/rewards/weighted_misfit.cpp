// Must-not-compile check (ok/ko pair): composing a text rule into a reward for an image batch is
// rejected with a message naming ScorerFor / RewardFor. As is (`_ok`), the batch has text.
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/weighted.hpp>

#include "test_batches.hpp"

torch::Tensor score_it() {
  unirl::rewards::weighted<unirl::rewards::exact_answer, unirl::rewards::regex_format> reward;
#if defined(UNIRL_FAILTEST_KO)
  rewards_test::image_batch batch{torch::zeros({2, 1, 4, 4})};
#else
  rewards_test::text_batch batch{.completions = {"1", "2"}, .references = {"1", "1"}};
#endif
  return reward(batch);
}
