// unirl-plan: what a Hugging Face decoder needs per device under data parallelism, ZeRO-2 and
// ZeRO-3, with and without bf16 autocast, activation checkpointing and LoRA, from its config.json
// alone (parallel::estimate_memory; docs/parallel.md#scale-on-paper). No LibTorch.
//   unirl-plan CONFIG [--ranks 8] [--device h100|h200|GB]... [--micro-batch 1] [--sequence 2048]
//              [--kv-tokens 0] [--lora-rank 16]
// CONFIG is a config.json or a model directory holding one. Prints a Markdown table (GB = 1e9 bytes).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <unirl/models/hf/config.hpp>
#include <unirl/parallel/memory_plan.hpp>

namespace {

namespace up = unirl::parallel;

[[noreturn]] void usage_error(const std::string& what) {
  std::cerr << "unirl-plan: " << what << " (see --help)\n";
  std::exit(2);
}

std::int64_t integer(const std::string& flag, const std::string& text, std::int64_t min) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || v < min)
    usage_error(flag + " '" + text + "': expected an integer >= " + std::to_string(min));
  return v;
}

std::string gb(std::int64_t bytes) {
  const double g = static_cast<double>(bytes) / 1e9;
  char buf[32];
  std::snprintf(buf, sizeof buf, g >= 100 ? "%.0f" : g >= 10 ? "%.1f" : "%.2f", g);
  return buf;
}

struct device {
  std::string name;
  double gb = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string config;
  std::int64_t ranks = 8, micro = 1, sequence = 2048, kv = 0, lora = 16;
  std::vector<device> devices;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + ": expected a value after it");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::cout << "unirl-plan CONFIG [--ranks 8] [--device h100|h200|GB]... [--micro-batch 1] [--sequence 2048]\n"
                   "           [--kv-tokens 0] [--lora-rank 16]\n"
                   "Per-device memory of a Hugging Face decoder (CONFIG: its config.json or directory) under\n"
                   "data parallelism, ZeRO-2 and ZeRO-3 over --ranks learner ranks, for float32, bf16 autocast,\n"
                   "bf16 with activation checkpointing and LoRA (rank --lora-rank, all linear layers, bf16 base,\n"
                   "checkpointing). Model state is exact for unirl's layouts; activations are an estimate\n"
                   "(docs/parallel.md#scale-on-paper). --device: h100 (80 GB), h200 (141 GB) or a size in GB;\n"
                   "default both. --kv-tokens: rollout-engine KV slots on the same device (bf16).\n";
      return 0;
    } else if (a == "--ranks") ranks = integer(a, value(), 1);
    else if (a == "--micro-batch") micro = integer(a, value(), 1);
    else if (a == "--sequence") sequence = integer(a, value(), 1);
    else if (a == "--kv-tokens") kv = integer(a, value(), 0);
    else if (a == "--lora-rank") lora = integer(a, value(), 1);
    else if (a == "--device") {
      const std::string d = value();
      if (d == "h100") devices.push_back({"H100 80 GB", 80});
      else if (d == "h200") devices.push_back({"H200 141 GB", 141});
      else if (d.find_first_not_of("0123456789") == std::string::npos && d != "0" && !d.empty()) devices.push_back({d + " GB", static_cast<double>(integer(a, d, 1))});
      else usage_error("--device '" + d + "': expected h100, h200 or a size in GB (an integer >= 1)");
    } else if (!a.empty() && a[0] == '-') usage_error("unknown option '" + a + "'");
    else if (config.empty()) config = a;
    else usage_error("one CONFIG only, got '" + config + "' and '" + a + "'");
  }
  if (config.empty()) usage_error("expected CONFIG: a config.json or a model directory");
  if (devices.empty()) devices = {{"H100 80 GB", 80}, {"H200 141 GB", 141}};
  try {
    const auto cfg = unirl::models::hf::decoder_config::load(config);
    const auto counts = up::count_parameters(cfg);
    std::cout << cfg.architecture_name() << ", " << counts.total << " parameters, " << cfg.num_hidden_layers
              << " layers; " << ranks << " ranks, micro-batch " << micro << " x " << sequence << " tokens"
              << (kv > 0 ? ", " + std::to_string(kv) + " KV slots (bf16)" : std::string()) << "; GB per device\n\n";
    struct row {
      const char* name;
      std::int64_t activation_bytes, lora_rank, frozen_bytes;
      bool checkpointing;
    };
    const std::string lora_name = "LoRA r" + std::to_string(lora) + ", bf16 base + checkpointing";
    const std::vector<row> rows{{"float32", 4, 0, 4, false},
                                {"bf16 autocast", 2, 0, 4, false},
                                {"bf16 + checkpointing", 2, 0, 4, true},
                                {lora_name.c_str(), 2, lora, 2, true}};
    std::cout << "| strategy | setup | parameters | gradients | optimizer | gathered | activations | KV | total |";
    for (const auto& d : devices) std::cout << " fits " << d.name << " |";
    std::cout << "\n|---|---|---:|---:|---:|---:|---:|---:|---:|";
    for (std::size_t i = 0; i < devices.size(); ++i) std::cout << ":-:|";
    std::cout << "\n";
    for (const auto strategy : {up::sharding::data_parallel, up::sharding::zero2, up::sharding::zero3})
      for (const auto& r : rows) {
        const auto m = up::estimate_memory(cfg, {.strategy = strategy, .ranks = ranks, .lora_rank = r.lora_rank,
                                                 .frozen_bytes = r.frozen_bytes, .activation_bytes = r.activation_bytes,
                                                 .checkpointing = r.checkpointing, .micro_batch = micro,
                                                 .sequence = sequence, .kv_tokens = kv, .kv_element_bytes = 2});
        std::cout << "| " << up::sharding_name(strategy) << " | " << r.name << " | " << gb(m.parameters) << " | "
                  << gb(m.gradients) << " | " << gb(m.optimizer) << " | " << gb(m.live) << " | " << gb(m.activations)
                  << " | " << gb(m.kv) << " | " << gb(m.total()) << " |";
        for (const auto& d : devices) std::cout << (static_cast<double>(m.total()) <= d.gb * 1e9 ? " yes |" : " no |");
        std::cout << "\n";
      }
  } catch (const std::exception& e) {
    std::cerr << "unirl-plan: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
