// The rollout engine on the Hugging Face decoders (Llama, Qwen2, Qwen3 with RoPE positions;
// GPT-2 with learned positions) loaded from the fixtures of tests/fixtures/hf: engine logits equal
// logits() over each whole sequence, one host read per engine step.
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/core/host.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/hf/pretrained.hpp>
#include <unirl/rollout/engine.hpp>

using namespace unirl;
namespace hf = unirl::models::hf;

namespace {
std::filesystem::path hf_fixture(const std::string& arch) {
  return std::filesystem::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "hf" / arch;
}
}  // namespace

TEST_CASE("engine: Hugging Face decoders - logits through the engine equal logits() (mixed lengths, chunked "
          "prefill, shared prefixes) and one host read per step", "[cpu][rollout][engine][hf]") {
  for (const std::string arch : {"llama", "qwen2", "qwen3", "gpt2"}) {
    for (const auto dt : {torch::kFloat, torch::kDouble}) {
      INFO(arch << " " << dt);
      auto lm = hf::from_pretrained(hf_fixture(arch));
      lm.net()->to(dt);
      lm.train(false);
      const auto V = lm.vocab_size();
      std::mt19937 rng(11);
      std::uniform_int_distribution<std::int64_t> tok(0, V - 1);
      std::vector<rollout::request> reqs;
      for (const std::int64_t len : {2, 7, 11, 1}) {
        std::vector<std::int64_t> p(static_cast<std::size_t>(len));
        for (auto& x : p) x = tok(rng);
        reqs.push_back({.prompt = p, .sampling = {.max_new_tokens = 6}, .seed = static_cast<std::uint64_t>(len),
                        .n = len % 2 == 1 ? 2 : 1});
      }
      rollout::engine eng{lm, {.block_size = 4, .kv_tokens = 256, .max_sequences = 8, .max_batch_tokens = 6,
                               .keep_logits = true}};
      for (const auto& r : reqs) eng.submit(r);
      std::vector<rollout::result> results;
      std::int64_t sampling_steps = 0;
      const auto reads_before = host_reads();
      while (eng.has_work()) {
        for (auto& r : eng.step()) results.push_back(std::move(r));
        if (eng.stats().sampled > 0) ++sampling_steps;
      }
      // One read per step that samples (tokens, log-probs, NaN flag); none in the forward itself.
      CHECK(host_reads() - reads_before == sampling_steps);
      REQUIRE(results.size() == 7);  // 1 + 2 + 2 + 2 samples
      const double tol = dt == torch::kDouble ? 1e-10 : 1e-5;
      for (const auto& r : results) {
        auto seq = reqs[static_cast<std::size_t>(r.request)].prompt;
        const auto P = static_cast<std::int64_t>(seq.size()), T = static_cast<std::int64_t>(r.tokens.size());
        seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
        const auto ids = torch::tensor(seq, torch::kInt64).unsqueeze(0);
        const auto ref = lm.logits(ids, torch::ones({1, ids.size(1)})).squeeze(0).slice(0, P - 1, P - 1 + T);
        CHECK((r.logits - ref).abs().max().item<double>() < tol);
        const auto lsm = torch::log_softmax(ref.to(torch::kDouble), -1);
        for (std::int64_t t = 0; t < T; ++t)
          CHECK(std::abs(r.logp[static_cast<std::size_t>(t)] - lsm[t][r.tokens[static_cast<std::size_t>(t)]].item<double>()) <
                10 * tol);
      }
    }
  }
}
