// `exec::cuda` in a build without the CUDA kernels does not compile, naming the option to set,
// instead of running the reference unasked. Registered only when UNIRL_ENABLE_CUDA is OFF.
#include <unirl/exec/policy.hpp>
#include <unirl/ops/logprob.hpp>

#if defined(UNIRL_FAILTEST_KO)
using policy = unirl::exec::cuda;
#else
using policy = unirl::exec::automatic;
#endif

unirl::ops::logprob_result run(const torch::Tensor& logits, const torch::Tensor& targets) {
  return unirl::ops::token_logprob<policy>(logits, targets);
}
