// Reward throughput, local vs remote on loopback (items_per_second = samples/s):
//   BM_reward_text_local/N       weighted<exact_answer, regex_format, overlong_penalty> on N completions
//   BM_reward_text_remote/N      the same scorer hosted by reward_server, one request per batch
//   BM_reward_text_remote_chunked/N  requests of 64 samples, 4 in flight
//   BM_reward_image_local/N      a small conv reward model on N 3x32x32 images
//   BM_reward_image_remote/N     the same behind the server (images travel as JSON numbers)
//   BM_reward_image_remote_base64/N  ... images as base64 raw bytes
#include <benchmark/benchmark.h>

#include <memory>
#include <string>

#include <torch/torch.h>

#include <unirl/rewards/model.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/server.hpp>
#include <unirl/rewards/weighted.hpp>

namespace rw = unirl::rewards;

namespace {
using text_reward = rw::weighted<rw::exact_answer, rw::regex_format, rw::overlong_penalty>;
text_reward make_text_reward() {
  return text_reward{{.weights = {1.0, 0.2, 1.0}}, rw::exact_answer{{.extract = R"(=\s*(-?\d+))", .numeric = true}},
                     rw::regex_format{{.pattern = R"(\d+[-+*]\d+=-?\d+)"}}, rw::overlong_penalty{{.max_length = 24, .cache_length = 8}}};
}

rw::json_batch text_batch(std::int64_t n) {
  rw::json_batch b;
  b.count = n;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto a = i % 97, c = (i * 7) % 89;
    b.prompts.push_back(std::to_string(a) + "+" + std::to_string(c));
    b.completions.push_back(b.prompts.back() + "=" + std::to_string(a + c + (i % 3 == 0 ? 1 : 0)));
    b.references.push_back(std::to_string(a + c));
  }
  return b;
}

struct conv_rm_impl : torch::nn::Module {
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear head{nullptr};
  conv_rm_impl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).stride(2)));
    head = register_module("head", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(conv(x)).mean({2, 3})); }
};
struct conv_rm : torch::nn::ModuleHolder<conv_rm_impl> {
  using ModuleHolder::ModuleHolder;
  conv_rm() : ModuleHolder(std::make_shared<conv_rm_impl>()) {}
};

rw::json_batch image_batch(std::int64_t n) {
  rw::json_batch b;
  b.count = n;
  b.images = torch::rand({n, 3, 32, 32});
  b.tensors["images"] = b.images;
  return b;
}

template <class Scorer>
void run(benchmark::State& state, Scorer& scorer, const rw::json_batch& batch) {
  for (auto _ : state) benchmark::DoNotOptimize(scorer(batch));
  state.SetItemsProcessed(state.iterations() * batch.size());
}
}  // namespace

static void BM_reward_text_local(benchmark::State& state) {
  auto reward = make_text_reward();
  run(state, reward, text_batch(state.range(0)));
}
BENCHMARK(BM_reward_text_local)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_reward_text_remote(benchmark::State& state) {
  rw::reward_server server{make_text_reward()};
  server.start();
  rw::remote_scorer remote{{.url = server.url(), .timeout_s = 30}};
  run(state, remote, text_batch(state.range(0)));
}
BENCHMARK(BM_reward_text_remote)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_reward_text_remote_chunked(benchmark::State& state) {
  rw::reward_server server{make_text_reward()};
  server.start();
  rw::remote_scorer remote{{.url = server.url(), .timeout_s = 30, .max_concurrency = 4, .chunk_size = 64}};
  run(state, remote, text_batch(state.range(0)));
}
BENCHMARK(BM_reward_text_remote_chunked)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_reward_image_local(benchmark::State& state) {
  torch::manual_seed(0);
  rw::learned_reward rm{conv_rm()};
  run(state, rm, image_batch(state.range(0)));
}
BENCHMARK(BM_reward_image_local)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_reward_image_remote(benchmark::State& state) {
  torch::manual_seed(0);
  rw::reward_server server{rw::learned_reward{conv_rm()}};
  server.start();
  rw::remote_scorer remote{{.url = server.url(), .timeout_s = 30}};
  run(state, remote, image_batch(state.range(0)));
}
BENCHMARK(BM_reward_image_remote)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_reward_image_remote_base64(benchmark::State& state) {
  torch::manual_seed(0);
  rw::reward_server server{rw::learned_reward{conv_rm()}};
  server.start();
  rw::remote_scorer remote{{.url = server.url(), .timeout_s = 30, .tensors = rw::tensor_encoding::base64}};
  run(state, remote, image_batch(state.range(0)));
}
BENCHMARK(BM_reward_image_remote_base64)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
