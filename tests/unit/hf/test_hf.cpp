// Hugging Face decoder architectures (include/unirl/models/hf/): LlamaForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM and GPT2LMHeadModel loaded from the fixtures of
// tests/fixtures/hf (written by make_fixtures.py with the official safetensors package) and checked
// against the logits and greedy continuations of the independent PyTorch implementation
// (hf_reference.py); the KV cache, packing, prefix sharing, the critic, the save/load round trip,
// load errors, and GRPO through unirl::trainer. The exported directories are read back by
// check_export.py (run here when a python3 with torch is found; UNIRL_HF_EXPORT_DIR keeps them).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/algorithms/grpo.hpp>
#include <unirl/algorithms/ppo_token.hpp>
#include <unirl/io/safetensors.hpp>
#include <unirl/models/hf/pretrained.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/parallel/memory_plan.hpp>
#include <unirl/rollout/engine.hpp>
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/trainer.hpp>

#include "fixture_files.hpp"

using namespace unirl;
namespace hf = unirl::models::hf;
namespace fs = std::filesystem;

namespace {

const std::vector<std::string> archs{"llama", "qwen2", "qwen3", "gpt2"};

fs::path fixtures() { return fs::path(UNIRL_SOURCE_DIR) / "tests" / "fixtures" / "hf"; }

std::map<std::string, torch::Tensor> reference(const std::string& arch) {
  return io::load_safetensors(fixtures() / (arch + ".reference.safetensors"));
}

// max |a - b| over the slots where mask (B, L) is 1.
double masked_max_diff(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& mask) {
  return ((a.to(torch::kFloat) - b.to(torch::kFloat)).abs().amax(-1) * mask).max().item<double>();
}

using unirl_test::copy_dir;
using unirl_test::edit_config;
using unirl_test::temp_dir;

std::vector<std::pair<std::string, torch::Tensor>> as_list(const std::map<std::string, torch::Tensor>& m) {
  return {m.begin(), m.end()};
}

// Fraction of generated tokens equal to `target` (an easy reward).
struct count_target {
  std::int64_t target = 7;
  torch::Tensor operator()(const token_rollout& b) const {
    const auto hit = (b.completion_ids == target).to(torch::kFloat) * b.completion_mask;
    return hit.sum(1) / b.completion_mask.sum(1).clamp_min(1.0);
  }
};

}  // namespace

TEST_CASE("hf: logits equal the independent PyTorch implementation (fp32 padded batch with left padding)",
          "[cpu][hf]") {
  torch::NoGradGuard ng;
  for (const auto& arch : archs) {
    INFO(arch);
    const auto lm = hf::from_pretrained(fixtures() / arch);
    const auto r = reference(arch);
    const auto logits = lm.logits(r.at("ids"), r.at("mask"));
    REQUIRE(logits.sizes() == r.at("logits").sizes());
    REQUIRE(logits.scalar_type() == torch::kFloat);
    const auto d = masked_max_diff(logits, r.at("logits"), r.at("mask"));
    std::printf("hf %-6s max |logit - reference| = %.3g (fp32)\n", arch.c_str(), d);
    CHECK(d <= 1e-5);
  }
  // GPT-2 as the original hub files lay it out (no "transformer." prefix, attn.bias buffers).
  const auto hub = hf::from_pretrained(fixtures() / "gpt2_hub");
  const auto r = reference("gpt2");
  CHECK(masked_max_diff(hub.logits(r.at("ids"), r.at("mask")), r.at("logits"), r.at("mask")) <= 1e-5);
  // Tensor names are Hugging Face's, one parameter per checkpoint tensor.
  const auto names = [](const hf::causal_lm& m) {
    std::vector<std::string> n;
    for (const auto& [k, v] : m.named_parameters()) n.push_back(k);
    return n;
  };
  const auto ln = names(hf::from_pretrained(fixtures() / "llama"));
  CHECK(ln.front() == "model.embed_tokens.weight");
  CHECK(std::find(ln.begin(), ln.end(), "model.layers.1.self_attn.k_proj.weight") != ln.end());
  CHECK(std::find(ln.begin(), ln.end(), "lm_head.weight") != ln.end());
  const auto qn = names(hf::from_pretrained(fixtures() / "qwen3"));
  CHECK(std::find(qn.begin(), qn.end(), "model.layers.0.self_attn.q_norm.weight") != qn.end());
  const auto gn = names(hub);
  CHECK(std::find(gn.begin(), gn.end(), "transformer.h.1.attn.c_attn.weight") != gn.end());
  CHECK(std::find(gn.begin(), gn.end(), "lm_head.weight") == gn.end());  // tied
  for (const auto& arch : archs) {
    const auto file = io::load_safetensors(fixtures() / arch / "model.safetensors");
    const auto m = hf::from_pretrained(fixtures() / arch);
    CHECK(m.named_parameters().size() == file.size());
    for (const auto& [k, v] : m.named_parameters()) CHECK(file.count(k) == 1);
  }
}

TEST_CASE("hf: bfloat16 weights - the fp32 upcast matches the reference and the bf16 forward the reference's bf16 forward",
          "[cpu][hf]") {
  torch::NoGradGuard ng;
  const auto r = reference("qwen3");
  const auto lm = hf::from_pretrained(fixtures() / "qwen3", {.dtype = hf::weight_dtype::as_config});
  REQUIRE(lm.dtype() == torch::kBFloat16);
  const auto logits = lm.logits(r.at("ids"), r.at("mask"));
  CHECK(logits.scalar_type() == torch::kBFloat16);
  const auto d16 = masked_max_diff(logits, r.at("logits_bfloat16"), r.at("mask"));
  const auto d32 = masked_max_diff(logits, r.at("logits"), r.at("mask"));
  const auto scale = r.at("logits").abs().max().item<double>();
  std::printf("hf qwen3  bf16 forward: max |logit - reference bf16| = %.3g, - reference fp32 = %.3g (|logit| <= %.3g)\n",
              d16, d32, scale);
  CHECK(d16 <= 0.02 * scale);  // a few bf16 steps (2^-5 at |logit| in [4, 8))
  CHECK(d32 <= 0.03 * scale);
}

TEST_CASE("hf: greedy decoding through the KV cache gives the reference tokens and cached logits equal the full forward",
          "[cpu][hf]") {
  torch::NoGradGuard ng;
  for (const auto& arch : archs) {
    INFO(arch);
    const auto lm = hf::from_pretrained(fixtures() / arch);
    const auto r = reference(arch);
    const auto& pids = r.at("prompt_ids");
    const auto& pmask = r.at("prompt_mask");
    const auto& expect = r.at("greedy");
    const auto B = pids.size(0), P = pids.size(1), T = expect.size(1);
    auto cache = lm.make_cache(B, P + T);
    // only the KV heads are cached
    const auto& c = lm.config();
    CHECK(cache.k[0].size(1) == (c.is_gpt2() ? c.num_attention_heads : c.num_key_value_heads));
    CHECK(cache.k[0].size(3) == (arch == "qwen3" ? 16 : c.hidden_size / c.num_attention_heads));
    std::vector<torch::Tensor> steps{lm.logits_cached(pids, pmask, cache)};
    std::vector<torch::Tensor> tokens;
    for (std::int64_t t = 0; t < T; ++t) {
      tokens.push_back(steps.back().select(1, steps.back().size(1) - 1).argmax(-1, true));
      if (t + 1 < T) steps.push_back(lm.logits_cached(tokens.back(), torch::ones({B, 1}), cache));
    }
    const auto got = torch::cat(tokens, 1);
    const auto same = torch::equal(got, expect);
    std::printf("hf %-6s greedy %lld tokens x %lld rows equal to the reference: %s (reference min top-2 gap %.3g)\n",
                arch.c_str(), static_cast<long long>(T), static_cast<long long>(B), same ? "yes" : "no",
                r.at("greedy_gap").item<double>());
    CHECK(same);
    // the cached pass equals the full forward over prompt + continuation
    const auto ids = torch::cat({pids, expect.slice(1, 0, T - 1)}, 1);
    const auto mask = torch::cat({pmask, torch::ones({B, T - 1})}, 1);
    const auto full = lm.logits(ids, mask);
    const auto inc = torch::cat(steps, 1);
    CHECK(masked_max_diff(full, inc, mask) <= 1e-5);
    // the library's sampler with top-k 1 draws the same continuation from the ragged prompts
    prompt_batch in;
    for (std::int64_t b = 0; b < B; ++b) {
      std::vector<std::int64_t> row;
      for (std::int64_t p = 0; p < P; ++p)
        if (pmask[b][p].item<float>() > 0) row.push_back(pids[b][p].item<std::int64_t>());
      in.tokens.push_back(row);
    }
    const auto s = sample_tokens(lm, in, 1, {.max_new_tokens = T, .top_k = 1});
    CHECK(torch::equal(s.completion_ids, expect));
  }
}

TEST_CASE("hf: packed forward equals the padded one and prefix sharing equals the unshared forward", "[cpu][hf]") {
  for (const auto& arch : archs) {
    INFO(arch);
    const auto lm = hf::from_pretrained(fixtures() / arch);
    const auto r = reference(arch);
    const auto& ids = r.at("ids");
    const auto& mask = r.at("mask");
    {
      torch::NoGradGuard ng;
      const auto padded = lm.logits(ids, mask);
      // the real tokens of each row, one after another in one row
      const auto keep = mask > 0;
      const auto counts = keep.sum(1);
      const auto packed_ids = ids.masked_select(keep).unsqueeze(0);
      std::vector<torch::Tensor> pos, seg;
      for (std::int64_t b = 0; b < ids.size(0); ++b) {
        pos.push_back(torch::arange(counts[b].item<std::int64_t>()));
        seg.push_back(torch::full({counts[b].item<std::int64_t>()}, b, torch::kInt64));
      }
      const auto packed = lm.logits_packed(packed_ids, torch::cat(pos).unsqueeze(0), torch::cat(seg).unsqueeze(0));
      const auto expect = padded.masked_select(keep.unsqueeze(-1)).view({1, -1, padded.size(-1)});
      CHECK((packed - expect).abs().max().item<double>() <= 1e-5);
    }
    // A GRPO-shaped rollout: 2 prompts x 3 completions; log-probs of the three update layouts
    // agree, and so do their gradients.
    torch::manual_seed(5);
    token_rollout b;
    b.prompt_ids = torch::tensor({{0L, 0L, 12L, 40L}, {3L, 9L, 27L, 81L}}).repeat_interleave(3, 0);
    b.prompt_mask = torch::tensor({{0.f, 0.f, 1.f, 1.f}, {1.f, 1.f, 1.f, 1.f}}).repeat_interleave(3, 0);
    b.completion_ids = torch::randint(1, 96, {6, 5}, torch::kInt64);
    b.completion_mask = torch::ones({6, 5});
    b.completion_mask[1].slice(0, 3).zero_();
    b.completion_mask[4].slice(0, 1).zero_();
    const auto grad_of = [&](models::update_layout layout) {
      auto m = lm.clone();
      auto [lp, ent] = models::update_logprob(m, b, 1.0, true, layout);
      lp = lp * b.completion_mask;
      (lp.sum() + 0.1 * (ent * b.completion_mask).sum()).backward();
      std::vector<torch::Tensor> g;
      for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
      return std::pair{lp.detach(), g};
    };
    const auto [lp_pad, g_pad] = grad_of(models::update_layout::padded);
    const auto [lp_pack, g_pack] = grad_of(models::update_layout::packed);
    const auto [lp_share, g_share] = grad_of(models::update_layout::shared_prompt);
    CHECK((lp_pad - lp_pack).abs().max().item<double>() <= 1e-5);
    CHECK((lp_pad - lp_share).abs().max().item<double>() <= 1e-5);
    double gd = 0;
    for (std::size_t i = 0; i < g_pad.size(); ++i)
      gd = std::max({gd, (g_pad[i] - g_pack[i]).abs().max().item<double>(),
                     (g_pad[i] - g_share[i]).abs().max().item<double>()});
    CHECK(gd <= 1e-4);
    // select_cache by hand: one prefill shared by three rows continues as three unshared rows do
    torch::NoGradGuard ng;
    auto shared = lm.make_cache(1, 8);
    lm.logits_cached(b.prompt_ids.slice(0, 3, 4), b.prompt_mask.slice(0, 3, 4), shared);
    auto rows = lm.select_cache(shared, torch::zeros({3}, torch::kInt64));
    const auto next = lm.logits_cached(b.completion_ids.slice(0, 3, 6).slice(1, 0, 2), torch::ones({3, 2}), rows);
    const auto full = lm.logits(torch::cat({b.prompt_ids.slice(0, 3, 6), b.completion_ids.slice(0, 3, 6).slice(1, 0, 2)}, 1),
                                torch::ones({3, 6}));
    CHECK((next - full.slice(1, 4)).abs().max().item<double>() <= 1e-5);
  }
}

TEST_CASE("hf: the critic's backbone is the policy's and packed values equal padded ones", "[cpu][hf]") {
  torch::NoGradGuard ng;
  for (const auto& arch : archs) {
    INFO(arch);
    const auto lm = hf::from_pretrained(fixtures() / arch);
    const auto critic = lm.make_critic();
    std::map<std::string, torch::Tensor> policy;
    for (const auto& [k, v] : lm.named_parameters()) policy[k] = v;
    std::size_t shared = 0;
    bool score = false;
    for (const auto& [k, v] : critic.named_parameters()) {
      if (k.starts_with("score.")) {
        score = true;
        continue;
      }
      REQUIRE(policy.count(k) == 1);
      CHECK(torch::equal(v, policy[k]));
      CHECK(v.data_ptr() != policy[k].data_ptr());  // a copy, trained separately
      ++shared;
    }
    CHECK(score);
    CHECK(shared == policy.size() - (lm.config().tie_word_embeddings ? 0 : 1));  // all but lm_head
    const auto r = reference(arch);
    const auto v = critic.values(r.at("ids"), r.at("mask"));
    CHECK(v.sizes() == r.at("ids").sizes());
    const auto keep = r.at("mask") > 0;
    const auto counts = keep.sum(1);
    std::vector<torch::Tensor> pos, seg;
    for (std::int64_t b = 0; b < 3; ++b) {
      pos.push_back(torch::arange(counts[b].item<std::int64_t>()));
      seg.push_back(torch::full({counts[b].item<std::int64_t>()}, b, torch::kInt64));
    }
    const auto vp = critic.values_packed(r.at("ids").masked_select(keep).unsqueeze(0), torch::cat(pos).unsqueeze(0),
                                         torch::cat(seg).unsqueeze(0));
    CHECK((vp.squeeze(0) - v.masked_select(keep)).abs().max().item<double>() <= 1e-5);
  }
}

TEST_CASE("hf: save_pretrained then from_pretrained is bit-identical (single file or shards) and copies tokenizer files",
          "[cpu][hf]") {
  temp_dir tmp;
  for (const auto& arch : archs) {
    INFO(arch);
    const auto src = fixtures() / arch;
    const auto lm = hf::from_pretrained(src);
    const auto out = tmp.path / arch;
    hf::save_pretrained(lm, out, {.copy_tokenizer_from = src.string()});
    // the written file holds exactly the source file's tensors, bit for bit, in the stored dtype
    const auto original = io::load_safetensors(src / "model.safetensors");
    const auto written = io::load_safetensors(out / "model.safetensors");
    REQUIRE(written.size() == original.size());
    for (const auto& [k, v] : original) {
      REQUIRE(written.count(k) == 1);
      CHECK(written.at(k).scalar_type() == v.scalar_type());
      CHECK(torch::equal(written.at(k), v));
    }
    CHECK(hf::decoder_config::load(out).to_json() == hf::decoder_config::load(src).to_json());
    const auto back = hf::from_pretrained(out);
    const auto a = lm.named_parameters(), b = back.named_parameters();
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].first == b[i].first);
      CHECK(torch::equal(a[i].second, b[i].second));
    }
    // sharded: several files and an index, read back the same
    const auto sharded = tmp.path / (arch + "_sharded");
    hf::save_pretrained(lm, sharded, {.dtype = hf::weight_dtype::float32, .max_shard_bytes = 40'000});
    CHECK(fs::exists(sharded / "model.safetensors.index.json"));
    CHECK_FALSE(fs::exists(sharded / "model.safetensors"));
    const auto c = hf::from_pretrained(sharded).named_parameters();
    for (std::size_t i = 0; i < a.size(); ++i) CHECK(torch::equal(a[i].second, c[i].second));
    CHECK(hf::decoder_config::load(sharded).torch_dtype == "float32");
  }
  // the tokenizer file was copied byte for byte
  std::ifstream x(fixtures() / "llama" / "tokenizer_config.json"), y(tmp.path / "llama" / "tokenizer_config.json");
  std::stringstream xs, ys;
  xs << x.rdbuf();
  ys << y.rdbuf();
  CHECK(!xs.str().empty());
  CHECK(xs.str() == ys.str());
  // a tied model whose file also holds lm_head.weight loads too (the tensor is the embedding)
  const auto tied = tmp.path / "qwen2_with_head";
  copy_dir(fixtures() / "qwen2", tied);
  auto t = io::load_safetensors(tied / "model.safetensors");
  t["lm_head.weight"] = t.at("model.embed_tokens.weight").clone();
  io::save_safetensors(tied / "model.safetensors", as_list(t));
  torch::NoGradGuard ng;
  const auto r = reference("qwen2");
  CHECK(masked_max_diff(hf::from_pretrained(tied).logits(r.at("ids"), r.at("mask")), r.at("logits"), r.at("mask")) <=
        1e-5);
}

TEST_CASE("hf: load errors name the file and the tensor or the key", "[cpu][hf]") {
  temp_dir tmp;
  const auto src = fixtures() / "llama";
  const auto fresh = [&](const std::string& name) {
    const auto d = tmp.path / name;
    copy_dir(src, d);
    return d;
  };
  {  // a tensor missing from the checkpoint
    const auto d = fresh("missing");
    auto t = io::load_safetensors(d / "model.safetensors");
    t.erase("model.layers.1.mlp.up_proj.weight");
    io::save_safetensors(d / "model.safetensors", as_list(t));
    CHECK_THROWS_WITH(hf::from_pretrained(d), Catch::Contains("model.layers.1.mlp.up_proj.weight"));
  }
  {  // a tensor of the wrong shape
    const auto d = fresh("shape");
    auto t = io::load_safetensors(d / "model.safetensors");
    t["model.layers.0.self_attn.k_proj.weight"] = torch::zeros({64, 64});
    io::save_safetensors(d / "model.safetensors", as_list(t));
    CHECK_THROWS_WITH(hf::from_pretrained(d), Catch::Contains("model.layers.0.self_attn.k_proj.weight"));
  }
  {  // an unexpected tensor
    const auto d = fresh("unexpected");
    auto t = io::load_safetensors(d / "model.safetensors");
    t["model.layers.2.mlp.up_proj.weight"] = torch::zeros({96, 64});
    io::save_safetensors(d / "model.safetensors", as_list(t));
    CHECK_THROWS_WITH(hf::from_pretrained(d), Catch::Contains("model.layers.2.mlp.up_proj.weight"));
  }
  const auto config_error = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit,
                                const std::string& expect) {
    INFO(name);
    const auto d = fresh(name);
    edit_config(d, edit);
    CHECK_THROWS_WITH(hf::from_pretrained(d), Catch::Contains(expect) && Catch::Contains("config.json"));
  };
  config_error("missing_key", [](nlohmann::json& j) { j.erase("num_hidden_layers"); }, "'num_hidden_layers' is missing");
  config_error("bad_type", [](nlohmann::json& j) { j["hidden_size"] = "64"; }, "'hidden_size' = \"64\"");
  config_error("bad_heads", [](nlohmann::json& j) { j["num_key_value_heads"] = 3; }, "'num_key_value_heads' = 3");
  config_error("rope", [](nlohmann::json& j) { j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}}; },
               "'rope_scaling'");
  config_error("arch", [](nlohmann::json& j) { j["architectures"] = {"MistralForCausalLM"}; }, "MistralForCausalLM");
  config_error("act", [](nlohmann::json& j) { j["hidden_act"] = "gelu"; }, "'hidden_act' = \"gelu\"");
  config_error("eos", [](nlohmann::json& j) { j["eos_token_id"] = 500; }, "'eos_token_id' = 500");
  {
    const auto d = fresh("qwen3_head_dim");
    fs::remove_all(d);
    copy_dir(fixtures() / "qwen3", d);
    edit_config(d, [](nlohmann::json& j) { j.erase("head_dim"); });
    CHECK_THROWS_WITH(hf::from_pretrained(d), Catch::Contains("'head_dim' is missing"));
  }
  {
    const auto d = fresh("sliding");
    edit_config(d, [](nlohmann::json& j) {
      j["architectures"] = {"Qwen2ForCausalLM"};
      j["model_type"] = "qwen2";
      j["use_sliding_window"] = true;
    });
    CHECK_THROWS_WITH(hf::from_pretrained(d), Catch::Contains("'use_sliding_window'"));
  }
  {
    const auto d = fresh("not_json");
    std::ofstream(d / "config.json") << "{\"vocab_size\": 96,";
    CHECK_THROWS_WITH(hf::from_pretrained(d), Catch::Contains("not valid JSON") && Catch::Contains("config.json"));
  }
  CHECK_THROWS_WITH(hf::from_pretrained(tmp.path / "nowhere"), Catch::Contains("nowhere"));
  CHECK_THROWS_WITH(hf::from_pretrained(src, {.device = "tpu"}), Catch::Contains("\"tpu\""));
  // the config round trip keeps unknown keys and GPT-2's own names
  const auto g = hf::decoder_config::load(fixtures() / "gpt2").to_json();
  CHECK(g.at("n_embd") == 32);
  CHECK(g.at("n_inner").is_null());
  CHECK(g.at("resid_pdrop") == 0.1);
  CHECK_FALSE(g.contains("hidden_size"));
  const auto q = hf::decoder_config::load(fixtures() / "qwen3");
  CHECK(q.eos_token_id == std::vector<std::int64_t>{95, 2});
  CHECK(q.to_json().at("eos_token_id") == nlohmann::json::array({95, 2}));
  // bad inputs to the model
  const auto lm = hf::from_pretrained(src);
  CHECK_THROWS_WITH(lm.logits(torch::tensor({{1L, 96L}}), torch::ones({1, 2})), Catch::Contains("token id 96"));
  auto cache = lm.make_cache(1, 2);
  CHECK_THROWS_WITH(lm.logits_cached(torch::tensor({{1L, 2L, 3L}}), torch::ones({1, 3}), cache),
                    Catch::Contains("KV cache holds 2"));
}

TEST_CASE("hf: GRPO through unirl::trainer trains a Hugging Face model and the export reads back in Python",
          "[cpu][hf][integration]") {
  temp_dir tmp;
  const char* keep = std::getenv("UNIRL_HF_EXPORT_DIR");
  const fs::path exports = keep ? fs::path(keep) : tmp.path / "export";
  fs::create_directories(exports);

  torch::manual_seed(0);
  auto lm = hf::from_pretrained(fixtures() / "qwen2");
  const auto before = lm.clone();
  trainer<hf::causal_lm, algo::grpo<>, count_target> t{
      lm, count_target{},
      {.optim = {.lr = 1e-2},
       .group_size = 4,
       .seed = 3,
       .progress = false}};
  const prompt_batch in{.tokens = {{5, 17, 33}, {60, 4}}};
  for (int s = 0; s < 2; ++s) {
    const auto st = t.step(in);
    if (s == 0) CHECK(st.ratio_mean == Approx(1.0).margin(1e-6));
    CHECK(std::isfinite(st.loss));
  }
  const auto& trained = t.models().policy;
  bool changed = false;
  const auto a = before.named_parameters(), b = trained.named_parameters();
  for (std::size_t i = 0; i < a.size(); ++i) changed = changed || !torch::equal(a[i].second, b[i].second);
  CHECK(changed);

  // PPO builds its critic from the same model (make_critic) and runs a step.
  trainer<hf::causal_lm, algo::ppo<exec::automatic, token_track>, count_target> ppo{
      hf::from_pretrained(fixtures() / "gpt2"), count_target{},
      {.optim = {.lr = 1e-3}, .group_size = 2, .progress = false}};
  REQUIRE(ppo.models().critic.has_value());
  CHECK(std::isfinite(ppo.step(in).loss));

  // Export: the trained Qwen2, and each fixture with its weights moved in C++ (so Python reads
  // values only unirl wrote), plus a sharded export. unirl's logits on the fixture inputs go
  // next to each directory as <name>.unirl.safetensors for check_export.py.
  torch::manual_seed(1);
  std::vector<std::pair<std::string, hf::causal_lm>> exported{{"qwen2_grpo", trained}};
  for (const auto& arch : archs) {
    auto m = hf::from_pretrained(fixtures() / arch);
    torch::NoGradGuard ng;
    for (auto& p : m.parameters()) p.add_(torch::randn_like(p) * 0.05);
    exported.emplace_back(arch + "_moved", m);
  }
  {  // a model built from a hand-written config (no head_dim, no num_key_value_heads: defaults)
    hf::decoder_config c;
    c.arch = hf::architecture::qwen2;
    c.vocab_size = 96;
    c.hidden_size = 40;
    c.intermediate_size = 56;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 5;
    c.max_position_embeddings = 64;
    c.tie_word_embeddings = true;
    c.initializer_range = 0.15;
    c.eos_token_id = {95};
    hf::causal_lm m(c);
    CHECK(m.config().head_size() == 8);
    CHECK(m.config().kv_heads() == 5);
    CHECK(m.net()->model->layers[0]->as<hf::detail::llama_layer_impl>()->self_attn->q_proj->bias.defined());
    const auto j = m.config().to_json();
    CHECK(j.at("head_dim") == 8);
    CHECK(j.at("num_key_value_heads") == 5);
    CHECK(j.at("architectures") == nlohmann::json::array({"Qwen2ForCausalLM"}));
    exported.emplace_back("qwen2_handmade", m);
  }
  for (const auto& [name, m] : exported) {
    const bool shard = name == "llama_moved";
    hf::save_pretrained(m, exports / name, {.max_shard_bytes = shard ? 100'000u : 5'000'000'000u});
    const auto back = hf::from_pretrained(exports / name);  // as stored (qwen3: bf16 upcast)
    const auto r = reference("llama");
    torch::NoGradGuard ng;
    const auto logits = back.logits(r.at("ids"), r.at("mask")) * r.at("mask").unsqueeze(-1);
    io::save_safetensors(exports / (name + ".unirl.safetensors"),
                         {{"ids", r.at("ids")}, {"mask", r.at("mask")}, {"logits", logits.contiguous()}});
  }
  CHECK(fs::exists(exports / "llama_moved" / "model.safetensors.index.json"));
  // Debian's python3-torch (which the torchscript test uses too); the safetensors package is
  // optional there: check_export.py falls back to a minimal reader of the format.
  std::string python;
  for (const std::string p : {"python3", "/usr/bin/python3"})
    if (python.empty() && std::system((p + " -c 'import torch' > /dev/null 2>&1").c_str()) == 0) python = p;
  if (python.empty()) {
    WARN("python3 with torch not found: run tests/fixtures/hf/check_export.py on UNIRL_HF_EXPORT_DIR by hand");
    return;
  }
  const auto cmd = python + " " + (fixtures() / "check_export.py").string() + " " + exports.string();
  CHECK(std::system(cmd.c_str()) == 0);
}

TEST_CASE("hf: the update's chunked LM-head log-probs equal the materialised logits' (values, entropies, gradients)",
          "[cpu][hf]") {
  static_assert(HiddenStateCausalLM<hf::causal_lm>);
  // The independent path: the whole (B, T, V) logits, log_softmax, gather, -sum p log p.
  const auto materialised = [](const hf::causal_lm& m, const token_rollout& b, double temp) {
    const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1);
    const auto logits = m.logits(b.full_ids().slice(1, 0, P + T - 1), b.full_mask().slice(1, 0, P + T - 1));
    const auto lsm = torch::log_softmax(logits.slice(1, P - 1) / temp, -1);
    return std::pair{lsm.gather(-1, b.completion_ids.unsqueeze(-1)).squeeze(-1), -(lsm.exp() * lsm).sum(-1)};
  };
  for (const auto& arch : archs) {
    INFO(arch);
    const auto lm = hf::from_pretrained(fixtures() / arch);
    REQUIRE(rollout::uses_hidden_states(lm));
    torch::manual_seed(11);
    token_rollout b;  // 2 prompts x 3 completions, left-padded prompts, ragged completions
    b.prompt_ids = torch::tensor({{0L, 0L, 12L, 40L}, {3L, 9L, 27L, 81L}}).repeat_interleave(3, 0);
    b.prompt_mask = torch::tensor({{0.f, 0.f, 1.f, 1.f}, {1.f, 1.f, 1.f, 1.f}}).repeat_interleave(3, 0);
    b.completion_ids = torch::randint(1, 96, {6, 5}, torch::kInt64);
    b.completion_mask = torch::ones({6, 5});
    b.completion_mask[2].slice(0, 2).zero_();
    b.completion_mask[3].slice(0, 4).zero_();
    const auto& mask = b.completion_mask;
    {  // the concept's contract: logits = hidden_states @ lm_head_weight^T
      torch::NoGradGuard ng;
      const auto ids = b.full_ids(), fm = b.full_mask();
      const auto d = masked_max_diff(torch::matmul(lm.hidden_states(ids, fm), lm.lm_head_weight().t()),
                                     lm.logits(ids, fm), fm);
      CHECK(d <= 1e-5);
    }
    const double temp = 0.7;
    // log-probs, entropies and every parameter's gradient of mean(logp) + 0.3 mean(entropy) over the mask
    const auto run = [&](const std::function<std::pair<torch::Tensor, torch::Tensor>(const hf::causal_lm&)>& f) {
      auto m = lm.clone();
      auto [lp, ent] = f(m);
      (((lp + 0.3 * ent) * mask).sum() / mask.sum()).backward();
      std::vector<torch::Tensor> g;
      for (const auto& p : m.parameters()) g.push_back(p.grad().clone());
      return std::tuple{(lp * mask).detach(), (ent * mask).detach(), g};
    };
    const auto [lp_ref, ent_ref, g_ref] = run([&](const hf::causal_lm& m) { return materialised(m, b, temp); });
    const auto compare = [&](const char* what,
                             const std::tuple<torch::Tensor, torch::Tensor, std::vector<torch::Tensor>>& got) {
      INFO(what);
      const auto& [lp, ent, g] = got;
      const double dl = (lp - lp_ref).abs().max().item<double>(), de = (ent - ent_ref).abs().max().item<double>();
      double dg = 0, gmax = 0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        dg = std::max(dg, (g[i] - g_ref[i]).abs().max().item<double>());
        gmax = std::max(gmax, g_ref[i].abs().max().item<double>());
      }
      std::printf("hf %-6s chunked %-13s max |dlogp| %.2g, |dentropy| %.2g, |dgrad| %.2g (|grad| <= %.3g)\n",
                  arch.c_str(), what, dl, de, dg, gmax);
      CHECK(dl <= 1e-5);
      CHECK(de <= 1e-5);
      CHECK(dg <= 1e-5);
    };
    for (const auto layout : {models::update_layout::padded, models::update_layout::packed,
                              models::update_layout::shared_prompt})
      compare(std::string(enum_names<models::update_layout>[static_cast<std::size_t>(layout)]).c_str(),
              run([&](const hf::causal_lm& m) { return models::update_logprob(m, b, temp, true, layout); }));
    // several chunks, the last one ragged (7 of the 30 rows at a time)
    compare("chunk=7", run([&](const hf::causal_lm& m) {
              const auto P = b.prompt_ids.size(1), T = b.completion_ids.size(1);
              const auto h = m.hidden_states(b.full_ids().slice(1, 0, P + T - 1), b.full_mask().slice(1, 0, P + T - 1));
              return rollout::head_logprob(h.slice(1, P - 1), m.lm_head_weight(), b.completion_ids, temp, true, 7);
            }));
  }
}

// ----------------------------------------------------------------------------------------------
// LoRA (include/unirl/models/lora.hpp) on the Hugging Face decoders and the built-in GPT.

namespace {

// Every parameter of `m` whose name holds ".lora_" (the adapters).
bool is_lora_name(const std::string& n) {
  return n.find(".lora_A.") != std::string::npos || n.find(".lora_B.") != std::string::npos;
}

// Bytes of AdamW's state (exp_avg, exp_avg_sq, max_exp_avg_sq, step) held by `opt`.
std::int64_t adamw_state_bytes(torch::optim::AdamW& opt) {
  std::int64_t n = 0;
  for (const auto& [key, st] : opt.state()) {
    (void)key;
    const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(st.get());
    REQUIRE(s != nullptr);
    for (const auto* t : {&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq()})
      if (t->defined()) n += t->nbytes();
  }
  return n;
}

// A small Qwen2-family config (GQA, q/k/v biases, tied embeddings) of the given sizes.
hf::decoder_config qwen2_shaped(std::int64_t vocab, std::int64_t hidden, std::int64_t inter, std::int64_t layers,
                                std::int64_t heads, std::int64_t kv_heads) {
  hf::decoder_config c;
  c.arch = hf::architecture::qwen2;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.max_position_embeddings = 128;
  c.tie_word_embeddings = true;
  return c;
}

// Parameter + AdamW-state bytes after one optimizer step on a next-token loss, and the bytes of the
// model's weights alone (before any adapter).
struct train_bytes {
  std::int64_t base = 0, params = 0, optimizer = 0, trainable = 0;
};
train_bytes measure_training_bytes(const hf::decoder_config& c, std::int64_t rank) {
  torch::manual_seed(0);
  hf::causal_lm lm(c);
  train_bytes b;
  for (const auto& [n, t] : lm.named_parameters()) b.base += t.nbytes();
  if (rank > 0) lora::apply(lm, {.rank = rank, .alpha = 2.0 * static_cast<double>(rank)});
  train::optimizer opt(lm.named_parameters(), {.lr = 1e-4});
  const auto ids = torch::randint(c.vocab_size, {2, 16}, torch::kInt64);
  const auto logits = lm.logits(ids, torch::ones({2, 16}));
  const auto loss = torch::nn::functional::cross_entropy(logits.slice(1, 0, 15).reshape({-1, c.vocab_size}),
                                                         ids.slice(1, 1).reshape({-1}));
  opt.zero_grad();
  loss.backward();
  opt.step();
  for (const auto& [n, t] : lm.named_parameters()) {
    b.params += t.nbytes();
    if (t.requires_grad()) b.trainable += t.nbytes();
  }
  b.optimizer = adamw_state_bytes(opt.torch_optimizer());
  return b;
}

}  // namespace

TEST_CASE("lora: zero-initialised adapters leave the logits unchanged; apply freezes the base and adapts the "
          "matching linear layers",
          "[cpu][hf][lora]") {
  const auto r = reference("llama");
  const auto ids = r.at("ids"), mask = r.at("mask");
  for (const std::string arch : {"qwen2", "gpt2"}) {
    INFO(arch);
    auto lm = hf::from_pretrained(fixtures() / arch);
    torch::NoGradGuard ng;
    const auto base = lm.logits(ids, mask);
    auto cache = lm.make_cache(ids.size(0), ids.size(1));
    const auto base_cached = lm.logits_cached(ids, mask, cache);
    const auto adapted = lora::apply(lm, {.rank = 4, .alpha = 8});
    // all-linear: every projection of every layer, no head
    const std::vector<std::string> kinds = arch == "gpt2"
        ? std::vector<std::string>{"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}
        : std::vector<std::string>{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"};
    CHECK(adapted.size() == kinds.size() * static_cast<std::size_t>(lm.config().num_hidden_layers));
    for (const auto& k : kinds)
      CHECK(std::count_if(adapted.begin(), adapted.end(), [&](const auto& n) { return n.ends_with("." + k); }) ==
            lm.config().num_hidden_layers);
    std::int64_t trainable = 0;
    for (const auto& [n, t] : lm.named_parameters()) {
      INFO(n);
      CHECK(t.requires_grad() == is_lora_name(n));
      trainable += t.requires_grad();
      if (n.ends_with(".lora_B.weight")) CHECK(t.abs().max().item<double>() == 0.0);
    }
    CHECK(trainable == 2 * static_cast<std::int64_t>(adapted.size()));
    {  // PEFT's shapes: A (r, in), B (out, r); GPT-2's Conv1D weight is stored (in, out)
      const auto p = lm.net()->named_parameters();
      const std::string m = arch == "gpt2" ? "transformer.h.0.mlp.c_fc" : "model.layers.0.mlp.gate_proj";
      const auto w = p[m + ".weight"];
      const auto in = arch == "gpt2" ? w.size(0) : w.size(1), out = arch == "gpt2" ? w.size(1) : w.size(0);
      CHECK(p[m + ".lora_A.weight"].sizes() == torch::IntArrayRef({4, in}));
      CHECK(p[m + ".lora_B.weight"].sizes() == torch::IntArrayRef({out, 4}));
      // A as a linear layer's default init: U(-1/sqrt(in), 1/sqrt(in)), not all zero
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      CHECK(p[m + ".lora_A.weight"].abs().max().item<double>() <= bound);
      CHECK(p[m + ".lora_A.weight"].abs().max().item<double>() > 0.5 * bound);
    }
    // Bit-identical with LibTorch 1.13; with 2.6 a wrapped linear layer with a bias (Qwen2's
    // q/k/v) goes through another kernel, a few ulps from the fused one.
    CHECK((lm.logits(ids, mask) - base).abs().max().item<double>() <= 1e-5);
    auto cache2 = lm.make_cache(ids.size(0), ids.size(1));
    CHECK((lm.logits_cached(ids, mask, cache2) - base_cached).abs().max().item<double>() <= 1e-5);
    // errors: already adapted; rank 0
    CHECK_THROWS_WITH(lora::apply(lm, {.rank = 4}), Catch::Contains("already has adapters"));
  }
  {  // target patterns: a subset, by last name or longer suffix; a pattern that matches nothing names the layers
    auto lm = hf::from_pretrained(fixtures() / "qwen2");
    const auto a = lora::apply(lm, {.rank = 2, .targets = {"q_proj", "mlp.down_proj"}});
    CHECK(a.size() == 2 * static_cast<std::size_t>(lm.config().num_hidden_layers));
    for (const auto& n : a) CHECK((n.ends_with(".self_attn.q_proj") || n.ends_with(".mlp.down_proj")));
    auto other = hf::from_pretrained(fixtures() / "qwen2");
    CHECK_THROWS_WITH(lora::apply(other, {.rank = 2, .targets = {"q_proj", "qproj"}}),
                      Catch::Contains("\"qproj\" matches no linear layer") && Catch::Contains("gate_proj"));
    CHECK_THROWS_WITH(lora::apply(other, {.rank = 2, .targets = {"lm_head"}}), Catch::Contains("\"lm_head\""));
    CHECK_THROWS_WITH(lora::apply(other, {.rank = 0}), Catch::Contains("lora.rank"));
    CHECK_THROWS_AS(lora::apply(other, {.rank = 2, .dropout = 1.5}), config_error);
    for (const auto& [n, t] : other.named_parameters()) CHECK(t.requires_grad());  // nothing changed by a failure
    torch::nn::Linear plain(4, 4);
    CHECK_THROWS_WITH(lora::apply(*plain, {.rank = 2}), Catch::Contains("lora::adaptable"));
  }
  {  // the built-in GPT: qkv, proj, fc1, fc2 of every block; the head is left alone
    torch::manual_seed(0);
    models::gpt g({.vocab_size = 16, .max_len = 16, .n_layer = 2, .n_head = 2, .d_model = 16});
    const auto gi = torch::randint(16, {3, 7}, torch::kInt64);
    const auto gm = torch::ones({3, 7});
    torch::NoGradGuard ng;
    const auto before = g.logits(gi, gm);
    const auto a = lora::apply(g, {.rank = 2});
    CHECK(a == std::vector<std::string>{"blocks.0.fc1", "blocks.0.fc2", "blocks.0.proj", "blocks.0.qkv", "blocks.1.fc1",
                                        "blocks.1.fc2", "blocks.1.proj", "blocks.1.qkv"});
    CHECK(torch::equal(g.logits(gi, gm), before));
    // a non-zero B changes the output by exactly (alpha / r) B A x at that layer: compare with the merged copy
    for (auto& [n, t] : g.named_parameters())
      if (n.ends_with("lora_B.weight")) t.normal_(0.0, 0.1);
    const auto moved = g.logits(gi, gm);
    CHECK((moved - before).abs().max().item<double>() > 1e-4);
    auto merged = g.clone();
    lora::merge(merged);
    CHECK_FALSE(lora::has_adapters(merged.named_parameters()));
    CHECK((merged.logits(gi, gm) - moved).abs().max().item<double>() <= 1e-5);
    {
      lora::disabled_guard off;
      CHECK(torch::equal(g.logits(gi, gm), before));
    }
  }
}

TEST_CASE("lora: GRPO trains only the adapters, the base stays bit-identical, the reference is the base with the "
          "adapters off, and a resumed run is bit-identical",
          "[cpu][hf][lora][integration]") {
  temp_dir tmp;
  torch::manual_seed(0);
  const auto base = hf::from_pretrained(fixtures() / "qwen2");
  using grpo_t = trainer<hf::causal_lm, algo::grpo<>, count_target>;
  const grpo_t::options o{.algorithm = {.kl_coef = 0.05}, .optim = {.lr = 5e-2}, .group_size = 4, .seed = 3,
                          .progress = false};
  auto make = [&] {
    auto lm = base.clone();
    torch::manual_seed(11);
    lora::apply(lm, {.rank = 4, .alpha = 8});
    return grpo_t{lm, count_target{}, o};
  };
  const prompt_batch in{.tokens = {{5, 17, 33}, {60, 4}}};
  auto t = make();
  const auto& policy = t.models().policy;
  REQUIRE(t.models().reference.has_value());
  {  // the reference is the policy's own weights (no copy)
    const auto p = policy.named_parameters(), q = t.models().reference->named_parameters();
    REQUIRE(p.size() == q.size());
    for (std::size_t i = 0; i < p.size(); ++i) CHECK(p[i].second.data_ptr() == q[i].second.data_ptr());
  }
  {  // the optimizer holds the adapters and nothing else
    std::set<const void*> lora_params;
    for (const auto& [n, p] : policy.named_parameters())
      if (is_lora_name(n)) lora_params.insert(p.unsafeGetTensorImpl());
    std::size_t held = 0;
    for (std::size_t g = 0; g < t.optimizer().group_count(); ++g)
      for (const auto& p : t.optimizer().group_params(g)) {
        CHECK(lora_params.count(p.unsafeGetTensorImpl()) == 1);
        ++held;
      }
    CHECK(held == lora_params.size());
  }
  {  // the KL to the reference: 0 before any update (zero-initialised B: the policy is the base) to
     // float noise, > 0 after one — it would stay 0 if the algorithm scored the reference with the
     // adapters on. The noise, most likely: the reference's forward runs without gradients, so q/k/v and
     // gate/up run as one fused matmul (hf::fused_linears), the policy's one by one; on some CPUs
     // BLAS blocks the two widths differently (measured 3.3e-9 on one machine, 0 on another).
    const auto first = t.step(in), second = t.step(in);
    CHECK(std::isfinite(first.loss));
    CHECK(std::isfinite(second.loss));
    INFO("KL to the LoRA reference: " << first.kl << " before any update, " << second.kl << " after one");
    CHECK(std::abs(first.kl) < 1e-7);
    CHECK(second.kl > 1e-6);
  }
  t.save((tmp.path / "step2.pt").string());
  for (int s = 0; s < 2; ++s) t.step(in);
  {  // base weights bit-identical, adapters moved (B away from zero)
    std::map<std::string, torch::Tensor> b;
    for (const auto& [n, p] : base.named_parameters()) b[n] = p;
    double b_max = 0;
    for (const auto& [n, p] : policy.named_parameters()) {
      if (is_lora_name(n)) {
        if (n.ends_with("lora_B.weight")) b_max = std::max(b_max, p.abs().max().item<double>());
        continue;
      }
      INFO(n);
      CHECK(torch::equal(p, b.at(n)));
    }
    CHECK(b_max > 1e-4);
  }
  {  // reference log-probs = the base model's: score one batch with the base as policy (pi_old) and the
     // trained LoRA model as reference; the adapted policy's own log-probs differ
    model_set<hf::causal_lm> ms{base};
    ms.reference.emplace(policy);
    torch::manual_seed(5);
    const step_info info{.group_size = 4};
    const sampling_options s{.max_new_tokens = 6};
    const auto b = algo::sample_for_update(ms, in, info, s, true);
    REQUIRE(b.ref_logp.defined());
    CHECK(torch::equal(b.ref_logp, b.old_logp));
    torch::NoGradGuard ng;
    const auto full = b.full_ids(), fmask = b.full_mask();
    CHECK(masked_max_diff(policy.logits(full, fmask), base.logits(full, fmask), fmask) > 1e-6);
  }
  {  // resume: the checkpoint after 2 steps, 2 more steps -> the same weights and optimizer state bit for bit
    auto u = make();
    u.load((tmp.path / "step2.pt").string());
    for (int s = 0; s < 2; ++s) u.step(in);
    const auto p = policy.named_parameters(), q = u.models().policy.named_parameters();
    REQUIRE(p.size() == q.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      INFO(p[i].first);
      CHECK(p[i].first == q[i].first);
      CHECK(torch::equal(p[i].second, q[i].second));
    }
  }
}

TEST_CASE("lora: the merged export equals the adapted model, and the PEFT adapter files read back in Python",
          "[cpu][hf][lora]") {
  temp_dir tmp;
  const char* keep = std::getenv("UNIRL_LORA_EXPORT_DIR");
  const fs::path exports = keep ? fs::path(keep) : tmp.path / "lora";
  fs::create_directories(exports);
  const auto r = reference("llama");
  const auto ids = r.at("ids"), mask = r.at("mask");
  for (const std::string arch : {"qwen2", "gpt2"}) {
    INFO(arch);
    torch::manual_seed(2);
    auto lm = hf::from_pretrained(fixtures() / arch);
    lora::apply(lm, {.rank = 4, .alpha = 8, .dropout = 0.1});
    torch::NoGradGuard ng;
    for (auto& [n, t] : lm.named_parameters())
      if (n.ends_with("lora_B.weight")) t.normal_(0.0, 0.2);  // trained adapters, as far as the export can tell
    lm.train(false);  // dropout acts in training mode only
    const auto adapted = lm.logits(ids, mask);
    CHECK(((adapted - lm.logits(ids, mask)).abs().max().item<double>()) == 0.0);
    {
      lora::disabled_guard off;
      const auto plain = hf::from_pretrained(fixtures() / arch).logits(ids, mask);
      CHECK(torch::equal(lm.logits(ids, mask), plain));
      CHECK(masked_max_diff(adapted, plain, mask) > 1e-3);  // the adapters matter
    }
    // save_pretrained writes the merged weights under the base names only
    hf::save_pretrained(lm, exports / (arch + "_merged"));
    const auto merged = hf::from_pretrained(exports / (arch + "_merged"));
    CHECK_FALSE(lora::has_adapters(merged.named_parameters()));
    CHECK(merged.named_parameters().size() + 2 * lora::adapted_modules(*lm.net()).size() ==
          lm.named_parameters().size());
    const double d = masked_max_diff(merged.logits(ids, mask), adapted, mask);
    std::printf("lora %-5s merged export vs adapted model: max |dlogit| %.2g\n", arch.c_str(), d);
    CHECK(d <= 1e-5);
    // clone keeps the adapters (and the frozen base)
    const auto copy = lm.clone();
    CHECK(torch::equal(copy.logits(ids, mask), adapted));
    for (const auto& [n, t] : copy.named_parameters()) CHECK(t.requires_grad() == is_lora_name(n));
    // in-place merge: a plain, fully trainable model with the adapted logits
    auto folded = lm.clone();
    lora::merge(folded);
    CHECK(masked_max_diff(folded.logits(ids, mask), adapted, mask) <= 1e-5);
    for (const auto& [n, t] : folded.named_parameters()) CHECK((t.requires_grad() && !is_lora_name(n)));

    // the adapter alone, in PEFT's layout
    const auto dir = exports / (arch + "_adapter");
    lora::save_adapter(lm, dir, {.base_model_name_or_path = arch});
    nlohmann::json cfg;
    std::ifstream(dir / "adapter_config.json") >> cfg;
    CHECK(cfg.at("peft_type") == "LORA");
    CHECK(cfg.at("r") == 4);
    CHECK(cfg.at("lora_alpha") == 8.0);
    CHECK(cfg.at("lora_dropout") == 0.1);
    CHECK(cfg.at("fan_in_fan_out") == (arch == "gpt2"));
    CHECK(cfg.at("bias") == "none");
    CHECK(cfg.at("task_type") == "CAUSAL_LM");
    const auto targets = cfg.at("target_modules").get<std::vector<std::string>>();
    CHECK(targets == (arch == "gpt2" ? std::vector<std::string>{"c_attn", "c_fc", "c_proj"}
                                     : std::vector<std::string>{"down_proj", "gate_proj", "k_proj", "o_proj",
                                                                "q_proj", "up_proj", "v_proj"}));
    io::save_safetensors(exports / (arch + ".lora.unirl.safetensors"),
                         {{"ids", ids}, {"mask", mask}, {"logits", (adapted * mask.unsqueeze(-1)).contiguous()}});
  }
  {  // a model without adapters has nothing to save
    const auto plain = hf::from_pretrained(fixtures() / "qwen2");
    CHECK_THROWS_WITH(lora::save_adapter(plain, tmp.path / "none"), Catch::Contains("no adapters"));
  }
  // The official safetensors package reads the adapter; Python merges it into the fixture's base
  // weights itself and the independent implementation's logits must equal unirl's adapted ones
  // (and the merged export's weights its own merge).
  std::string python;
  for (const std::string p : {"python3", "/usr/bin/python3"})
    if (python.empty() && std::system((p + " -c 'import torch, safetensors' > /dev/null 2>&1").c_str()) == 0)
      python = p;
  if (python.empty()) {
    WARN("python3 with torch and safetensors not found: run tests/fixtures/hf/check_lora_adapter.py on "
         "UNIRL_LORA_EXPORT_DIR by hand");
    return;
  }
  const auto cmd = python + " " + (fixtures() / "check_lora_adapter.py").string() + " " + exports.string() + " " +
                   fixtures().string();
  CHECK(std::system(cmd.c_str()) == 0);
}

TEST_CASE("lora: parameter + optimizer bytes of rank-16 adapters against full fine-tuning (Qwen2.5-0.5B layer shapes)",
          "[cpu][hf][lora]") {
  // Qwen2.5-0.5B's layer shapes (hidden 896, MLP 4864, 14 query / 2 KV heads), two layers, a vocabulary
  // cut to 4096 so the test stays small (the hidden test below uses the full 151936).
  const auto c = qwen2_shaped(4096, 896, 4864, 2, 14, 2);
  const auto full = measure_training_bytes(c, 0), lo = measure_training_bytes(c, 16);
  const double full_ratio = static_cast<double>(full.params + full.optimizer) / static_cast<double>(full.base);
  const double lora_ratio = static_cast<double>(lo.params + lo.optimizer) / static_cast<double>(lo.base);
  std::printf("lora memory (2 layers, vocab 4096): weights %.1f MB; full fine-tuning params+AdamW %.1f MB (%.2fx); "
              "LoRA r=16 params+AdamW %.1f MB (%.3fx, %.2f MB trainable)\n",
              full.base / 1e6, (full.params + full.optimizer) / 1e6, full_ratio, (lo.params + lo.optimizer) / 1e6,
              lora_ratio, lo.trainable / 1e6);
  CHECK(full.optimizer == 2 * full.params);  // AdamW's two moments of every parameter
  CHECK(lo.optimizer == 2 * lo.trainable);   // ... of the adapters only
  CHECK(lora_ratio <= 1.2);
  CHECK(full_ratio >= 2.9);
}

TEST_CASE("lora: memory at Qwen2.5-0.5B's full shape (4 layers, vocabulary 151936)", "[.lora-memory]") {
  const auto c = qwen2_shaped(151936, 896, 4864, 4, 14, 2);
  for (const std::int64_t rank : {0, 16}) {
    const auto b = measure_training_bytes(c, rank);
    std::printf("lora memory (Qwen2.5-0.5B shape, 4 layers): rank %lld: weights %.1f MB, params %.1f MB, trainable "
                "%.2f MB, AdamW state %.2f MB, params+AdamW %.1f MB = %.3fx the weights\n",
                static_cast<long long>(rank), b.base / 1e6, b.params / 1e6, b.trainable / 1e6, b.optimizer / 1e6,
                (b.params + b.optimizer) / 1e6, static_cast<double>(b.params + b.optimizer) / b.base);
  }
}

TEST_CASE("hf: logits(ids) of unpadded ids equals logits(ids, a mask of ones)", "[cpu][hf]") {
  torch::manual_seed(0);
  hf::causal_lm lm(qwen2_shaped(50, 32, 64, 2, 4, 2));
  torch::NoGradGuard ng;
  const auto ids = torch::randint(50, {2, 7}, torch::kInt64);
  CHECK(torch::equal(lm.logits(ids), lm.logits(ids, torch::ones({2, 7}))));
}

// ----------------------------------------------------------------------------------------------
// Scale on paper (include/unirl/parallel/memory_plan.hpp): the parameter counts and KV bytes the
// plan computes from a config alone equal the built models'; the model-state terms are checked
// against the engine's measurement on real ranks in unit_distributed.

namespace {
std::pair<std::int64_t, std::int64_t> built_counts(const hf::causal_lm& lm) {
  std::int64_t total = 0, trainable = 0;
  for (const auto& p : lm.net()->parameters()) {
    total += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  return {total, trainable};
}
}  // namespace

TEST_CASE("memory plan: parameter counts from config.json equal the built decoders', with and without LoRA, and the "
          "published checkpoints' counts", "[cpu][hf][memory_plan]") {
  namespace up = unirl::parallel;
  for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3"}) {
    INFO(arch);
    const auto cfg = hf::decoder_config::load(fixtures() / arch);
    {
      const auto lm = hf::from_pretrained(fixtures() / arch);
      const auto [total, trainable] = built_counts(lm);
      const auto c = up::count_parameters(cfg);
      CHECK(c.total == total);
      CHECK(c.trainable == trainable);
      CHECK(c.frozen == 0);
      std::int64_t layer0 = 0;
      for (const auto& p : lm.net()->named_parameters())
        if (p.key().starts_with(lm.net()->block_prefixes().front())) layer0 += p.value().numel();
      CHECK(c.layer_trainable == layer0);
      CHECK(c.rest_trainable + c.layers * c.layer_trainable == c.trainable);
    }
    const std::vector<std::string> attention = arch == "gpt2" ? std::vector<std::string>{"c_attn"}
                                                               : std::vector<std::string>{"q_proj", "self_attn.v_proj"};
    for (const auto& targets : {std::vector<std::string>{"all-linear"}, attention}) {
      auto lm = hf::from_pretrained(fixtures() / arch);
      unirl::lora::apply(lm, {.rank = 3, .targets = targets});
      const auto [total, trainable] = built_counts(lm);
      const auto c = up::count_parameters(cfg, 3, targets);
      CHECK(c.total == total);
      CHECK(c.trainable == trainable);
      CHECK(c.rest_trainable == 0);
    }
    CHECK_THROWS_WITH(up::count_parameters(cfg, 4, {"qkv"}), Catch::Contains("lora.targets") && Catch::Contains("\"qkv\""));
  }
  // Published counts (the configs in docs/configs; GPT-2 small from its hub config).
  const auto docs = fs::path(UNIRL_SOURCE_DIR) / "docs" / "configs";
  CHECK(up::count_parameters(hf::decoder_config::load(docs / "qwen2.5-0.5b.json")).total == 494'032'768);
  CHECK(up::count_parameters(hf::decoder_config::load(docs / "qwen2.5-7b.json")).total == 7'615'616'512);
  CHECK(up::count_parameters(hf::decoder_config::load(docs / "llama-3-70b.json")).total == 70'553'706'496);
  const auto gpt2_small = hf::decoder_config::from_json(nlohmann::json{
      {"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", 50257}, {"n_positions", 1024},
      {"n_embd", 768}, {"n_layer", 12}, {"n_head", 12}, {"eos_token_id", 50256}});
  CHECK(up::count_parameters(gpt2_small).total == 124'439'808);
}

TEST_CASE("memory plan: KV bytes per token equal the rollout engine's pool; strategies and settings are checked",
          "[cpu][hf][memory_plan]") {
  namespace up = unirl::parallel;
  for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3"}) {
    INFO(arch);
    const auto lm = hf::from_pretrained(fixtures() / arch);
    const unirl::rollout::engine<hf::causal_lm> e(lm, {.block_size = 8, .kv_tokens = 64});
    const auto cfg = hf::decoder_config::load(fixtures() / arch);
    CHECK(up::estimate_memory(cfg, {.kv_tokens = 1}).kv == e.slot_bytes());
    CHECK(up::estimate_memory(cfg, {.kv_tokens = 1000}).kv == 1000 * e.slot_bytes());
  }
  const auto cfg = hf::decoder_config::load(fixtures() / "qwen2");
  const auto dp = up::estimate_memory(cfg, {});
  const auto c = dp.counts;
  // Data parallelism: parameters, gradients and two moments of every trainable element.
  CHECK(dp.engine_model_state == 16 * c.trainable);
  CHECK(dp.model_state() == dp.engine_model_state);
  // ZeRO-2 over 4 ranks keeps the parameters and the local gradients whole; the moments are a quarter.
  const auto z2 = up::estimate_memory(cfg, {.strategy = up::sharding::zero2, .ranks = 4});
  CHECK(z2.parameters == 4 * c.trainable);
  CHECK(z2.optimizer == 2 * 4 * (c.trainable / 4));
  // ZeRO-3: under 1/N of the unsharded state plus the gathered units; LoRA: the frozen base whole.
  const auto z3 = up::estimate_memory(cfg, {.strategy = up::sharding::zero3, .ranks = 4});
  CHECK(z3.parameters + z3.gradients + z3.optimizer <= dp.model_state() / 4 + 16 * 4 * (c.layers + 1));
  CHECK(z3.live > 0);
  const auto lora = up::estimate_memory(cfg, {.strategy = up::sharding::zero3, .ranks = 4, .lora_rank = 2, .frozen_bytes = 2});
  CHECK(lora.parameters >= 2 * lora.counts.frozen);
  CHECK(lora.counts.frozen == c.total);
  // Checkpointing keeps less; bf16 activations are half.
  const auto ck = up::estimate_memory(cfg, {.checkpointing = true});
  CHECK(ck.activations < dp.activations);
  CHECK(up::estimate_memory(cfg, {.activation_bytes = 2}).activations * 2 == dp.activations);
  CHECK_THROWS_WITH(up::estimate_memory(cfg, {.ranks = 0}), Catch::Contains("ranks") && Catch::Contains("0"));
  CHECK_THROWS_WITH(up::estimate_memory(cfg, {.ranks = 2, .rank = 2}), Catch::Contains("rank") && Catch::Contains("[0, ranks)"));
  CHECK_THROWS_WITH(up::estimate_memory(cfg, {.weight_bytes = 3}), Catch::Contains("weight_bytes") && Catch::Contains("3"));
  CHECK_THROWS_WITH(up::parse_sharding("zero4"), Catch::Contains("zero4") && Catch::Contains("dp, zero1, zero2 or zero3"));
  CHECK(up::parse_sharding("zero3") == up::sharding::zero3);
}
