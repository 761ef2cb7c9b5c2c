// dp_worker's modes for fully sharded data parallelism (parallel/fully_sharded.hpp, ZeRO-3), SFT
// on the Qwen2 fixture decoder (tests/fixtures/hf/qwen2); included by dp_worker.cpp only.
//   dp_worker fsdp_single 0 1 <store-file> <out-prefix>   one process, no sharding, the whole batches
//   dp_worker fsdp_sft|fsdp_sft_ckpt <rank> <world> ...   ZeRO-3 (with activation checkpointing)
//   dp_worker fsdp_resume <rank> 2 ...                    2 steps on 2 ranks, a sharded save, then
//       rank 0 alone (a world of 1) loads it and takes steps 2 and 3 on the whole batches
//   dp_worker fsdp_fault <rank> 2 ...                     rank 1 exits before step 2
//   dp_worker plan_dp|plan_zero2 <rank> <world> ...       the same SFT under data parallelism / ZeRO-2:
//       the engine's model-state accounting, for the memory plan (parallel/memory_plan.hpp)
#pragma once
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/models/hf/pretrained.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/fully_sharded.hpp>
#include <unirl/parallel/zero.hpp>
#include <unirl/train/sft.hpp>

namespace fsdp_modes {

using gloo_fsdp = unirl::parallel::fully_sharded<unirl::parallel::gloo>;
using lm = unirl::models::hf::causal_lm;

inline constexpr std::int64_t rows = 12;  // the global batch: divides over 1, 2, 3 and 4 ranks
inline constexpr std::int64_t steps = 4;

// Step `step`'s global batch; every example has 2 completion tokens, so the mean of the ranks'
// token means is the whole batch's.
inline unirl::train::sft_batch global_batch(std::int64_t step) {
  std::vector<std::vector<std::int64_t>> prompts, completions;
  for (std::int64_t i = 0; i < rows; ++i) {
    prompts.push_back({1 + (i + step) % 90, 3 + (7 * i + step) % 80, 2 + (3 * i + step) % 85});
    completions.push_back({1 + (i + 2 * step) % 93, 1 + (5 * i + step) % 91});
  }
  return unirl::train::make_sft_batch(prompts, completions, 0);
}
inline unirl::train::sft_batch rank_batch(std::int64_t step, int rank, int world) {
  const std::int64_t n = rows / world;
  return global_batch(step).select(torch::arange(n * rank, n * (rank + 1), torch::kInt64));
}

inline lm fixture(bool checkpointing) {
  auto m = unirl::models::hf::from_pretrained(std::filesystem::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "hf" / "qwen2");
  if (checkpointing) m.set_checkpointing({"decoder_blocks"});
  return m;
}

// AdamW's eps at 1e-6: an element whose gradient is float noise (the key biases', which the
// softmax over keys is invariant to) would otherwise turn either run's noise into steps of lr.
template <class Parallel>
unirl::train::sft_trainer<lm, Parallel> make_trainer(lm model, Parallel par) {
  return unirl::train::sft_trainer<lm, Parallel>(
      std::move(model),
      {.optim = {.lr = 1e-2, .eps = 1e-6, .weight_decay = 0.01}, .clip = {.max_grad_norm = 0.5}, .micro_batch_size = 2,
       .batch_size = rows, .steps = steps, .seed = 3, .progress = false},
      std::move(par));
}

inline nlohmann::json params_of(const lm& m) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, p] : m.named_parameters()) {
    auto c = p.detach().reshape({-1}).to(torch::kFloat64).contiguous();
    out[name] = std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  }
  return out;
}

// Trains steps [from, to) on this rank's part of the global batches.
template <class Trainer>
void train(Trainer& t, std::int64_t from, std::int64_t to, int rank, int world, nlohmann::json& losses,
           nlohmann::json& norms) {
  for (std::int64_t s = from; s < to; ++s) {
    const auto st = t.step(rank_batch(s, rank, world));
    losses.push_back(st.loss);
    norms.push_back(st.grad_norm);
  }
}

inline nlohmann::json single() {
  auto t = make_trainer(fixture(false), unirl::parallel::single_device{});
  nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array();
  train(t, 0, steps, 0, 1, losses, norms);
  std::int64_t params = 0, block = 0;
  for (const auto& [name, p] : t.model().named_parameters()) {
    params += p.numel() * static_cast<std::int64_t>(p.element_size());
    if (name.starts_with("model.layers.0.")) block += p.numel() * static_cast<std::int64_t>(p.element_size());
  }
  return {{"losses", losses},
          {"grad_norms", norms},
          {"params", params_of(t.model())},
          {"model_state_bytes", t.engine().peak_model_state_bytes()},
          {"optimizer_state_bytes", t.engine().optimizer_state_bytes()},
          {"parameter_bytes", params},
          {"block_bytes", block}};
}

inline nlohmann::json sharded(gloo_fsdp par, bool checkpointing) {
  const int rank = par.rank(), world = par.world_size();
  auto t = make_trainer(fixture(checkpointing), std::move(par));
  nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array();
  train(t, 0, steps, rank, world, losses, norms);
  auto& fs = t.engine().parallel();
  const std::int64_t released = fs.current_bytes();  // the shards and their gradients only
  const auto params = fs.with_full_weights([&] { return params_of(t.model()); });
  std::int64_t sizes = 0;  // every parameter is released again: no storage left
  for (const auto& p : t.model().parameters()) sizes += static_cast<std::int64_t>(p.storage().nbytes());
  return {{"losses", losses},
          {"grad_norms", norms},
          {"params", params},
          {"model_state_bytes", t.engine().peak_model_state_bytes()},
          {"optimizer_state_bytes", t.engine().optimizer_state_bytes()},
          {"largest_block_bytes", fs.largest_block_bytes()},
          {"rest_bytes", fs.rest_bytes()},
          {"bytes_between_steps", released},
          {"parameter_storage_after", sizes}};
}

// Data parallelism or ZeRO-2 on the same steps: the engine's accounting of the model state.
template <class Parallel>
nlohmann::json unsharded_strategy(Parallel par) {
  const int rank = par.rank(), world = par.world_size();
  auto t = make_trainer(fixture(false), std::move(par));
  nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array();
  train(t, 0, steps, rank, world, losses, norms);
  return {{"losses", losses},
          {"model_state_bytes", t.engine().peak_model_state_bytes()},
          {"optimizer_state_bytes", t.engine().optimizer_state_bytes()}};
}

inline nlohmann::json resume(gloo_fsdp par, const std::string& out) {
  const int rank = par.rank(), world = par.world_size();
  const std::string dir = out + ".sharded";
  nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array();
  {
    auto t = make_trainer(fixture(false), std::move(par));
    train(t, 0, 2, rank, world, losses, norms);
    t.engine().parallel().save_sharded(dir, t.optim());
  }
  nlohmann::json res{{"losses", losses}};
  if (rank != 0) return res;
  // Rank 0 alone, a world of one on a store of its own: the 2-rank checkpoint, then steps 2 and 3.
  const unirl::parallel::rendezvous one{.file_path = out + ".single-store", .interface_host = "127.0.0.1",
                                        .timeout = std::chrono::seconds(60)};
  auto t = make_trainer(fixture(false), gloo_fsdp(unirl::parallel::data_parallel<unirl::parallel::gloo>(0, 1, one)));
  t.engine().parallel().load_sharded(dir, t.optim());
  nlohmann::json later = nlohmann::json::array(), later_norms = nlohmann::json::array();
  train(t, 2, steps, 0, 1, later, later_norms);
  res["resumed_losses"] = later;
  res["params"] = t.engine().parallel().with_full_weights([&] { return params_of(t.model()); });
  res["manifest"] = nlohmann::json::parse(std::ifstream(dir + "/manifest.json"));
  return res;
}

inline nlohmann::json fault(gloo_fsdp par, const std::string& out) {
  const int rank = par.rank(), world = par.world_size();
  auto t = make_trainer(fixture(false), std::move(par));
  nlohmann::json losses = nlohmann::json::array(), norms = nlohmann::json::array();
  train(t, 0, 2, rank, world, losses, norms);
  if (rank == 1) {  // killed between steps; the time of death first
    std::ofstream(out + ".died") << std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch()).count();
    std::raise(SIGKILL);
  }
  train(t, 2, steps, rank, world, losses, norms);  // must throw: a peer is gone
  return {{"losses", losses}};
}

// Runs `mode` when it is one of this file's; nullopt otherwise.
inline std::optional<nlohmann::json> run(const std::string& mode, int rank, int world, const std::string& store,
                                         const std::string& out) {
  if (mode.rfind("fsdp_", 0) != 0 && mode.rfind("plan_", 0) != 0) return std::nullopt;
  if (mode == "fsdp_single") return single();
  const unirl::parallel::rendezvous rdzv{.file_path = store, .interface_host = "127.0.0.1",
                                         .timeout = std::chrono::seconds(mode == "fsdp_fault" ? 20 : 60)};
  using gloo_dp = unirl::parallel::data_parallel<unirl::parallel::gloo>;
  if (mode == "plan_dp") return unsharded_strategy(gloo_dp(rank, world, rdzv));
  if (mode == "plan_zero2")
    return unsharded_strategy(unirl::parallel::zero<unirl::parallel::gloo>(gloo_dp(rank, world, rdzv), {.stage = 2}));
  gloo_fsdp par(unirl::parallel::data_parallel<unirl::parallel::gloo>(rank, world, rdzv));
  if (mode == "fsdp_sft") return sharded(std::move(par), false);
  if (mode == "fsdp_sft_ckpt") return sharded(std::move(par), true);
  if (mode == "fsdp_resume") return resume(std::move(par), out);
  if (mode == "fsdp_fault") return fault(std::move(par), out);
  return std::nullopt;
}

}  // namespace fsdp_modes
