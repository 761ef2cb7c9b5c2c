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
#include <unirl/rollout/token_sampler.hpp>
#include <unirl/trainer.hpp>

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

struct temp_dir {
  fs::path path;
  temp_dir() {
    std::mt19937_64 rng(std::random_device{}());
    path = fs::temp_directory_path() / ("unirl_hf_" + std::to_string(rng()));
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// A copy of a fixture directory whose config.json is edited by `edit`.
void copy_dir(const fs::path& from, const fs::path& to) {
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from)) fs::copy_file(e.path(), to / e.path().filename());
}
void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  std::ifstream(dir / "config.json") >> j;
  edit(j);
  std::ofstream(dir / "config.json") << j.dump(2);
}

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
