// The NCCL backends (built with -DUNIRL_ENABLE_NCCL=ON, a LibTorch with NCCL): every member of the
// data-parallel and ZeRO strategies over `nccl` and `gloo_nccl` compiles; the mixed group moves CPU
// tensors through Gloo between two ranks (threads of this process, on a FileStore), and, on a GPU,
// CUDA tensors through NCCL (one rank: NCCL takes one GPU per rank).
#if defined(UNIRL_WITH_NCCL)
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>
#include <catch2/catch.hpp>

#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/zero.hpp>

template class unirl::parallel::data_parallel<unirl::parallel::nccl>;
template class unirl::parallel::zero<unirl::parallel::nccl>;
template class unirl::parallel::data_parallel<unirl::parallel::gloo_nccl>;
template class unirl::parallel::zero<unirl::parallel::gloo_nccl>;

namespace {
std::string store_file(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() /
                 ("unirl-" + name + "-" + std::to_string(::getpid()) + "-" +
                  std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::remove(p);
  return p.string();
}
}  // namespace

TEST_CASE("gloo_nccl: CPU tensors go through Gloo in the mixed group, two ranks", "[cpu][distributed]") {
  const auto file = store_file("gloo-nccl");
  std::vector<torch::Tensor> sums(2), grads(2), weights(2);
  std::vector<std::string> errors(2);
  auto rank_main = [&](int rank) {
    try {
      unirl::parallel::data_parallel<unirl::parallel::gloo_nccl> dp(
          rank, 2, {.file_path = file, .interface_host = "127.0.0.1", .timeout = std::chrono::seconds(30)});
      std::vector<torch::Tensor> t{torch::full({3}, rank + 1.0)};
      dp.process_group().allreduce(t)->wait();
      sums[rank] = t[0];
      auto w = torch::full({2, 2}, 10.0 * (rank + 1)).requires_grad_(true);
      dp.broadcast({w}, 0);  // rank 0's weights everywhere
      (w * (rank + 1.0)).sum().backward();
      dp.all_reduce_gradients({w});
      grads[rank] = w.grad().clone();
      weights[rank] = w.detach().clone();
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  std::filesystem::remove(file);
  REQUIRE(errors[0].empty());
  REQUIRE(errors[1].empty());
  for (int r = 0; r < 2; ++r) {
    CHECK(torch::equal(sums[r], torch::full({3}, 3.0)));         // 1 + 2
    CHECK(torch::equal(weights[r], torch::full({2, 2}, 10.0)));  // rank 0's
    CHECK(torch::equal(grads[r], torch::full({2, 2}, 1.5)));     // the mean of 1 and 2
  }
}

TEST_CASE("gloo_nccl: a CUDA tensor goes through NCCL and a CPU tensor through Gloo in one group",
          "[cuda][distributed]") {
  if (!torch::cuda::is_available())
    SKIP("no CUDA device visible to LibTorch: the NCCL test needs a GPU (run scripts/gpu-check.sh on one)");
  const auto file = store_file("gloo-nccl-cuda");
  unirl::parallel::data_parallel<unirl::parallel::gloo_nccl> dp(0, 1,
                                                                {.file_path = file, .interface_host = "127.0.0.1"});
  std::vector<torch::Tensor> on_gpu{torch::full({4}, 2.0, torch::kCUDA)}, on_host{torch::full({4}, 3.0)};
  dp.process_group().allreduce(on_gpu)->wait();
  dp.process_group().allreduce(on_host)->wait();
  CHECK(dp.process_group().getBackend(c10::DeviceType::CUDA)->getBackendName() == "nccl");
  CHECK(dp.process_group().getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo");
  CHECK(torch::equal(on_gpu[0].cpu(), torch::full({4}, 2.0)));
  CHECK(torch::equal(on_host[0], torch::full({4}, 3.0)));
  std::filesystem::remove(file);
}
#endif
