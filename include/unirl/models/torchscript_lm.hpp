#pragma once
/// \file torchscript_lm.hpp
/// A `CausalLM` over a TorchScript module: a model written and scripted in Python
/// (`torch.jit.script(model).save("lm.pt")`) plugs into the same trainer as the built-in GPT.
///
/// The scripted module's `forward(ids: Tensor, mask: Tensor) -> Tensor` takes ids (B, L) int64
/// and mask (B, L) float and returns (B, L, V) logits. It has no KV cache of its own: the cache
/// keeps the sequence so far and each step recomputes it (correct for any module; a module with
/// its own cache can get an adapter of its own).
///
/// ```cpp
/// auto lm = unirl::models::torchscript_lm::load("lm.pt", /*vocab_size=*/32);
/// unirl::trainer<unirl::models::torchscript_lm, unirl::algo::grpo<>, my_reward> t{lm, reward, {}};
/// ```
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/script.h>
#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/core/error.hpp>
#include <unirl/models/causal_lm.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::models {

/// The growing sequence a `torchscript_lm` recomputes at each decoding step.
struct prefix_cache {
  torch::Tensor ids;   // (B, n) so far
  torch::Tensor mask;  // (B, n)
  std::int64_t capacity = 0;
};

/// `CausalLM` adapter of a scripted module (see the file comment).
class torchscript_lm {
 public:
  using track = token_track;
  using cache_type = prefix_cache;

  torchscript_lm(torch::jit::Module m, std::int64_t vocab_size) : m_(std::move(m)), vocab_(vocab_size) {
    UNIRL_CHECK(vocab_ >= 2, "torchscript_lm: vocab_size = ", vocab_, ": expected >= 2");
    UNIRL_CHECK(m_.find_method("forward").has_value(), "torchscript_lm: the module has no forward(ids, mask)");
  }
  /// Loads a scripted module from `path`; throws `unirl::error` naming the path when it cannot.
  static torchscript_lm load(const std::string& path, std::int64_t vocab_size) {
    try {
      return torchscript_lm(torch::jit::load(path), vocab_size);
    } catch (const c10::Error& e) {
      throw error("torchscript_lm: cannot load '" + path + "': " + e.what_without_backtrace());
    }
  }

  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor& mask) const {
    auto out = const_cast<torch::jit::Module&>(m_).forward({ids, mask.to(torch::kFloat)}).toTensor();
    UNIRL_CHECK(out.dim() == 3 && out.size(0) == ids.size(0) && out.size(1) == ids.size(1) && out.size(2) == vocab_,
                "torchscript_lm: forward returned sizes ", out.sizes(), "; expected (", ids.size(0), ", ", ids.size(1),
                ", ", vocab_, ")");
    return out;
  }
  prefix_cache make_cache(std::int64_t batch, std::int64_t capacity) const {
    return {torch::empty({batch, 0}, torch::kInt64), torch::empty({batch, 0}, torch::kFloat), capacity};
  }
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor& mask, prefix_cache& c) const {
    UNIRL_CHECK(c.ids.size(1) + ids.size(1) <= c.capacity, "torchscript_lm: the cache holds ", c.capacity,
                " tokens; ", c.ids.size(1) + ids.size(1), " needed");
    c.ids = torch::cat({c.ids.to(ids.device()), ids}, 1);
    c.mask = torch::cat({c.mask.to(ids.device()), mask.to(torch::kFloat)}, 1);
    return logits(c.ids, c.mask).slice(1, c.ids.size(1) - ids.size(1));
  }
  std::int64_t vocab_size() const { return vocab_; }

  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> out;
    for (const auto& p : m_.parameters()) out.push_back(p);
    return out;
  }
  named_tensors named_parameters() const {
    named_tensors out;
    for (const auto& p : m_.named_parameters()) out.emplace_back(p.name, p.value);
    return out;
  }
  named_tensors named_buffers() const {
    named_tensors out;
    for (const auto& b : m_.named_buffers()) out.emplace_back(b.name, b.value);
    return out;
  }
  /// A deep copy (independent parameters).
  torchscript_lm clone() const { return torchscript_lm(m_.deepcopy(), vocab_); }
  void train(bool on) { m_.train(on); }
  void to(torch::Device d) { m_.to(d); }
  torch::jit::Module& module() { return m_; }

 private:
  torch::jit::Module m_;
  std::int64_t vocab_;
};
static_assert(CausalLM<torchscript_lm>);

}  // namespace unirl::models
