// The update engine under the supervised stage (issue 27): micro-batches give the update of the
// whole batch (bf16 training: test_token.cpp, next to the fp32 SFT run).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/models/gpt.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/train/update_engine.hpp>

using namespace unirl;

namespace {
models::gpt engine_test_gpt() {
  torch::manual_seed(5);
  return models::gpt(models::gpt_options{.vocab_size = 14, .max_len = 12, .n_layer = 1, .n_head = 2, .d_model = 32});
}

// Eight examples whose completions differ in length (1 token for the first four, 3 for the last
// four), so that the two halves weigh differently in the batch's token mean.
train::sft_batch uneven_batch(std::int64_t shift) {
  std::vector<std::vector<std::int64_t>> prompts, completions;
  for (std::int64_t i = 0; i < 8; ++i) {
    prompts.push_back({1 + (i + shift) % 10, 11, 2 + (i * 3 + shift) % 9});
    if (i < 4) completions.push_back({1 + (i + 2 * shift) % 12});
    else completions.push_back({1 + (i + shift) % 12, 13, 1 + (2 * i + shift) % 12});
  }
  return train::make_sft_batch(prompts, completions, 0);
}
}  // namespace

TEST_CASE("sft_trainer: two micro-batches give the update of one batch of twice their size", "[cpu][sft][engine]") {
  const auto b0 = uneven_batch(0);
  // The halves weigh 4 and 12 tokens: the mean of the two halves' mean losses is not the batch's.
  {
    auto m = engine_test_gpt();
    const double whole = train::sft_loss(m, b0).item<double>();
    const auto lo = torch::arange(0, 4, torch::kInt64), hi = torch::arange(4, 8, torch::kInt64);
    const double naive = 0.5 * (train::sft_loss(m, b0.select(lo)).item<double>() +
                                train::sft_loss(m, b0.select(hi)).item<double>());
    CHECK(std::abs(whole - naive) > 1e-3);
  }
  using sft_t = train::sft_trainer<models::gpt>;
  const sft_t::options o{.optim = {.lr = 1e-2, .weight_decay = 0.01},
                         .clip = {.max_grad_norm = 1.0},
                         .batch_size = 8,
                         .steps = 3,
                         .progress = false};
  auto split = o;
  split.micro_batch_size = 4;
  sft_t one(engine_test_gpt(), o), two(engine_test_gpt(), split);
  for (std::int64_t step = 0; step < 3; ++step) {
    const auto b = uneven_batch(step);
    const auto s1 = one.step(b), s2 = two.step(b);
    INFO("step " << step << ": loss " << s1.loss << " (one batch) vs " << s2.loss << " (two micro-batches)");
    CHECK(s2.optimizer_steps == 1);
    CHECK(s2.examples == 8);
    CHECK(s2.tokens == 16);
    CHECK(s2.loss == Approx(s1.loss).epsilon(1e-5));
    CHECK(s2.grad_norm == Approx(s1.grad_norm).epsilon(1e-4));
  }
  const auto p1 = one.model().named_parameters(), p2 = two.model().named_parameters();
  REQUIRE(p1.size() == p2.size());
  const auto p0 = engine_test_gpt().named_parameters();
  double moved = 0.0;
  for (std::size_t i = 0; i < p1.size(); ++i) {
    INFO(p1[i].first);
    auto w1 = p1[i].second.detach(), w2 = p2[i].second.detach();
    if (p1[i].first.ends_with("qkv.bias")) {
      // The key bias gets no gradient (the softmax over keys is invariant to it): only float noise,
      // which AdamW normalises into steps of up to lr either way. It stays within 3 steps of lr of
      // where it started; the query and value biases are compared as every other weight.
      const auto k0 = p0[i].second.detach().slice(0, 32, 64);
      CHECK((w1.slice(0, 32, 64) - k0).abs().max().item<double>() <= 3 * 1e-2 * 1.01);
      CHECK((w2.slice(0, 32, 64) - k0).abs().max().item<double>() <= 3 * 1e-2 * 1.01);
      w1 = torch::cat({w1.slice(0, 0, 32), w1.slice(0, 64, 96)});
      w2 = torch::cat({w2.slice(0, 0, 32), w2.slice(0, 64, 96)});
    }
    CHECK(torch::allclose(w1, w2, 1e-4, 1e-5));
    moved = std::max(moved, (p1[i].second - p0[i].second).abs().max().item<double>());
  }
  CHECK(moved > 1e-3);  // the weights did change
  // A batch type without select(index) cannot be split: the error says so before any work.
  train::update_engine<> engine({.micro_batch_size = 2});
  auto w = torch::ones({3}, torch::requires_grad());
  engine.bind({{"w", w}}, "test");
  struct opaque {
    torch::Tensor x;
  };
  CHECK_THROWS_WITH(engine.step(opaque{torch::ones({3})},
                                [&](const opaque& b, std::int64_t) {
                                  return supervised_loss{(w * b.x).sum(), 1, 0};
                                }),
                    Catch::Contains("micro_batch_size = 2") && Catch::Contains("select(index)"));
}
