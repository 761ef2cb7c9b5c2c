// One GRPO update of a Hugging Face fixture model on the GPU equals the same update on the CPU:
// the same hand-made rollout (prompts, completions, pi_old, rewards), the algorithm's advantage
// and loss, the backward and one SGD step (Adam's first step, +-lr whatever the gradient's size,
// would turn rounding in a near-zero gradient into a full step), then the loss and the weights
// compared (float32 to 1e-4 relative to each tensor's largest magnitude: the update runs LibTorch's
// CUDA kernels and unirl's, whose sums are ordered differently). Skips without a CUDA device.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <catch2/catch.hpp>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/models/hf/pretrained.hpp>

namespace {
namespace hf = unirl::models::hf;

struct update_result {
  double loss = 0;
  std::vector<torch::Tensor> weights;  // on the CPU, after the step
};

update_result grpo_update(const std::string& device) {
  const auto dir = std::filesystem::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "hf" / "qwen2";
  unirl::model_set<hf::causal_lm> models{hf::from_pretrained(dir, {.device = device})};
  const torch::Device dev(device);
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  unirl::token_rollout b;
  b.prompt_ids =
      torch::tensor({0L, 5L, 17L, 33L, 0L, 5L, 17L, 33L, 0L, 0L, 60L, 4L, 0L, 0L, 60L, 4L}, i64).view({4, 4});
  b.prompt_mask = (b.prompt_ids != 0).to(torch::kFloat);
  b.completion_ids =
      torch::tensor({7L, 8L, 9L, 10L, 11L, 12L, 0L, 0L, 20L, 21L, 22L, 0L, 30L, 31L, 32L, 33L}, i64).view({4, 4});
  b.completion_mask = torch::tensor({1.f, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1}).view({4, 4});
  b.prompt_index = torch::tensor({0L, 0L, 1L, 1L}, i64);
  {  // pi_old: the policy's own log-probs, shifted a little so the ratio is not 1
    torch::NoGradGuard ng;
    const auto cpu = hf::from_pretrained(dir);
    const auto logits = cpu.logits(b.full_ids(), b.full_mask()).slice(1, 3, 7);
    b.old_logp =
        (torch::log_softmax(logits, -1).gather(2, b.completion_ids.unsqueeze(2)).squeeze(2) - 0.05) * b.completion_mask;
  }
  for (auto* t : {&b.prompt_ids, &b.prompt_mask, &b.completion_ids, &b.completion_mask, &b.old_logp, &b.prompt_index})
    *t = t->to(dev);
  unirl::algo::grpo<> algo{{}};
  unirl::step_info info{.step = 0, .group_size = 2, .device = dev, .updates = 2};
  algo.advantage(models, b, torch::tensor({1.f, 0.f, 0.25f, 1.f}).to(dev), info);
  auto params = models.policy.parameters();
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.5));
  const auto terms = algo.loss(models, b, info);
  opt.zero_grad();
  terms.total.backward();
  opt.step();
  update_result r{terms.total.item<double>(), {}};
  for (const auto& p : models.policy.parameters()) r.weights.push_back(p.detach().to(torch::kCPU));
  return r;
}
}  // namespace

TEST_CASE("one GRPO update of an HF fixture model on the GPU equals the CPU update", "[cuda][grpo]") {
  if (!torch::cuda::is_available())
    SKIP("no CUDA device visible to LibTorch: the GPU GRPO update needs a GPU (run scripts/gpu-check.sh on one)");
  torch::manual_seed(0);
  const auto cpu = grpo_update("cpu");
  const auto gpu = grpo_update("cuda");
  CHECK(gpu.loss == Approx(cpu.loss).epsilon(1e-4));
  REQUIRE(gpu.weights.size() == cpu.weights.size());
  for (std::size_t i = 0; i < cpu.weights.size(); ++i) {
    const double scale = std::max(cpu.weights[i].abs().max().item<double>(), 1e-30);
    INFO("parameter " << i << " sizes " << cpu.weights[i].sizes());
    CHECK((gpu.weights[i] - cpu.weights[i]).abs().max().item<double>() / scale < 1e-4);
  }
}
