#pragma once
/// \file lora.hpp
/// LoRA (low-rank adaptation, Hu et al. 2021) for every track: `lora::apply` attaches a pair of
/// low-rank factors to each linear layer of a network whose name matches the target patterns and
/// freezes everything else, so only the adapters train and reach the optimizer. A layer's output
/// becomes `W x + b + (alpha / r) * B (A dropout(x))`, with A (r, in) initialised as LibTorch
/// initialises a linear layer and B (out, r) zero, so an adapted model starts exactly as its base.
///
/// ```cpp
/// auto lm = unirl::models::hf::from_pretrained("Qwen2.5-0.5B");
/// unirl::lora::apply(lm, {.rank = 16, .alpha = 32});          // q/k/v/o, gate/up/down adapted
/// unirl::trainer<unirl::models::hf::causal_lm, unirl::algo::grpo<>, my_reward> t{lm, reward, {}};
/// // ... train: the reference (kl_coef > 0) is the same weights with the adapters switched off ...
/// unirl::lora::save_adapter(t.models().policy, "out/adapter", {.base_model_name_or_path = "Qwen2.5-0.5B"});
/// unirl::models::hf::save_pretrained(t.models().policy, "out/merged");  // W + (alpha / r) B A
/// {
///   unirl::lora::disabled_guard base;                      // forwards of this thread: base model
///   auto ref_logits = lm.logits(ids, mask);
/// }
/// ```
/// Parameter names follow PEFT: the adapters of `model.layers.0.self_attn.q_proj` are
/// `model.layers.0.self_attn.q_proj.lora_A.weight` (r, in) and `...lora_B.weight` (out, r), and
/// `save_adapter` writes them as `base_model.model.<name>` in `adapter_model.safetensors` with an
/// `adapter_config.json` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules, ...), the
/// directory PEFT's `PeftModel.from_pretrained` reads. The base parameters keep their names, so
/// checkpoints and Hugging Face loading are unchanged.
///
/// `lora::disabled_guard` (core/lora_guard.hpp, so the algorithms can use it) switches the
/// adapters off on its thread: a policy with adapters serves as its own reference model.
///
/// A network takes adapters when its forward calls its linear layers through `lora::forward` /
/// `lora::adapt` and it derives from `lora::adaptable` (the built-in GPT, the Hugging Face
/// decoders and the flow nets do); output heads (`lm_head`, `head`, `score`) are never adapted,
/// since the token track's update reads the LM head's weight directly. Without adapters the
/// forward is unchanged, bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/lora_guard.hpp>
#include <unirl/core/options.hpp>
#include <unirl/detail/compat.hpp>
#include <unirl/io/safetensors.hpp>

namespace unirl::lora {

/// What `apply` attaches. `rank` 0 means no adapters (full fine-tuning) wherever a recipe or an
/// example takes these options.
struct options {
  std::int64_t rank = 0;  // r: the adapters' inner dimension; 0 = LoRA off
  double alpha = 16.0;    // scaling = alpha / rank (PEFT's lora_alpha)
  double dropout = 0.0;   // dropout on the adapter's input, in training mode only
  // module names (or their last components) to adapt; all-linear: every linear layer but the heads
  std::vector<std::string> targets{"all-linear"};

  void validate(const std::string& p) const {
    ::unirl::options::require(rank >= 0, p + "rank", rank, ">= 0 (0: no adapters)");
    ::unirl::options::require(std::isfinite(alpha) && alpha > 0.0, p + "alpha", alpha, "a finite number > 0");
    ::unirl::options::require(dropout >= 0.0 && dropout < 1.0, p + "dropout", dropout, "in [0, 1)");
    ::unirl::options::require(!targets.empty(), p + "targets", "[]", "at least one module pattern (or all-linear)");
    for (const auto& t : targets)
      ::unirl::options::require(!t.empty() && t.front() != '.' && t.back() != '.', p + "targets", t,
                                "module names such as q_proj or self_attn.q_proj (or all-linear)");
  }
};

}  // namespace unirl::lora

BOOST_HANA_ADAPT_STRUCT(unirl::lora::options, rank, alpha, dropout, targets);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::lora::options>{
    unirl::options::field_doc{"rank", "LoRA rank r; 0 = no adapters (full fine-tuning)"},
    unirl::options::field_doc{"alpha", "scaling alpha / rank (PEFT lora_alpha)"},
    unirl::options::field_doc{"dropout", "dropout on the adapters' input while training"},
    unirl::options::field_doc{"targets", "module names (or last components) to adapt; all-linear = every linear layer but the heads"}};

namespace unirl::lora {

/// Marks a network whose forward runs every linear layer through `lora::forward` / `lora::adapt`,
/// so `apply` may attach adapters to them (a network that does not would ignore them silently).
class adaptable {
 public:
  virtual ~adaptable() = default;
};

/// Marks a linear module that stores its weight (in, out), as GPT-2's Conv1D does (PEFT's
/// `fan_in_fan_out`); it must have a 2-D `weight` parameter.
class fan_in_fan_out {
 public:
  virtual ~fan_in_fan_out() = default;
};

/// One LoRA factor: `lora_A` (r, in) or `lora_B` (out, r), a bias-free linear map whose only
/// parameter is `weight` (PEFT's names). The A factor's settings give the adapter's scaling.
class factor_impl : public torch::nn::Cloneable<factor_impl> {
 public:
  factor_impl(std::int64_t out, std::int64_t in, double alpha, std::int64_t rank, double dropout, bool fan_in_fan_out)
      : out_(out), in_(in), alpha_(alpha), rank_(rank), dropout_(dropout), fifo_(fan_in_fan_out) {
    reset();
  }
  void reset() override { weight = register_parameter("weight", torch::zeros({out_, in_})); }

  double alpha() const { return alpha_; }
  std::int64_t rank() const { return rank_; }
  double scaling() const { return alpha_ / static_cast<double>(rank_); }
  double dropout() const { return dropout_; }
  bool fan_in_fan_out() const { return fifo_; }

  torch::Tensor weight;

 private:
  std::int64_t out_, in_;
  double alpha_;
  std::int64_t rank_;
  double dropout_;
  bool fifo_;
};
TORCH_MODULE_IMPL(factor, factor_impl);

namespace detail {

// The adapter of `m`: its two children lora_A and lora_B, or nulls. A layer without children
// (every layer of a model without adapters) costs one empty vector.
inline std::pair<factor_impl*, factor_impl*> factors_of(const torch::nn::Module& m) {
  const auto kids = m.children();
  if (kids.size() != 2) return {nullptr, nullptr};
  auto* a = dynamic_cast<factor_impl*>(kids[0].get());
  auto* b = dynamic_cast<factor_impl*>(kids[1].get());
  if (!a || !b) return {nullptr, nullptr};
  return {a, b};
}

inline bool is_head(const std::string& name) {
  const auto dot = name.rfind('.');
  const auto last = dot == std::string::npos ? name : name.substr(dot + 1);
  return last == "lm_head" || last == "head" || last == "score";
}

inline bool matches(const std::string& name, const std::string& pattern) {
  return name == pattern ||
         (name.size() > pattern.size() && name.ends_with(pattern) && name[name.size() - pattern.size() - 1] == '.');
}

// (weight, fan_in_fan_out) of a module that can take an adapter, or an undefined weight.
inline std::pair<torch::Tensor, bool> linear_weight(const torch::nn::Module& m) {
  if (const auto* l = dynamic_cast<const torch::nn::LinearImpl*>(&m)) return {l->weight, false};
  if (dynamic_cast<const fan_in_fan_out*>(&m)) {
    for (const auto& p : m.named_parameters(/*recurse=*/false))
      if (p.key() == "weight" && p.value().dim() == 2) return {p.value(), true};
  }
  return {torch::Tensor(), false};
}

}  // namespace detail

/// `y` (the base layer's output on x) plus the adapter of module `m`, when it has one and adapters
/// are enabled: y + (alpha / r) * B(A(dropout(x))). Without an adapter `y` itself is returned.
/// Adapters of a half or bfloat16 model are float32 (as PEFT's autocast_adapter_dtype); the
/// adapter's part is added in y's dtype.
inline torch::Tensor adapt(const torch::nn::Module& m, const torch::Tensor& x, torch::Tensor y) {
  const auto [a, b] = detail::factors_of(m);
  if (!a || !enabled()) return y;
  auto h = x.scalar_type() == a->weight.scalar_type() ? x : x.to(a->weight.scalar_type());
  if (a->dropout() > 0.0 && a->is_training()) h = torch::dropout(h, a->dropout(), true);
  h = ::unirl::detail::compat::linear(::unirl::detail::compat::linear(h, a->weight), b->weight) * a->scaling();
  return y + (h.scalar_type() == y.scalar_type() ? h : h.to(y.scalar_type()));
}

/// A linear layer with its adapter: `lin(x)` plus the adapter's part.
inline torch::Tensor forward(torch::nn::LinearImpl& lin, const torch::Tensor& x) {
  return adapt(lin, x, ::unirl::detail::compat::linear_module(lin, x));  // lin.forward(x), folded on 2.x
}
inline torch::Tensor forward(const torch::nn::Linear& lin, const torch::Tensor& x) { return forward(*lin.ptr(), x); }

/// Whether a module tree (or a model's named parameters) holds adapters.
inline bool has_adapters(const torch::nn::Module& root) {
  for (const auto& p : root.named_parameters())
    if (p.key().ends_with(".lora_A.weight")) return true;
  return false;
}
inline bool has_adapters(const named_tensors& params) {
  return std::any_of(params.begin(), params.end(), [](const auto& p) { return p.first.ends_with(".lora_A.weight"); });
}

/// The modules of `root` that have adapters, by name.
inline std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> adapted_modules(
    const torch::nn::Module& root) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
  for (const auto& m : root.named_modules("", /*include_self=*/false))
    if (detail::factors_of(*m.value()).first) out.emplace_back(m.key(), m.value());
  return out;
}

/// Attaches adapters to the linear layers of `root` whose name matches one of `o.targets` (a
/// pattern matches a module name equal to it or ending in "." + pattern, as PEFT's
/// target_modules; `all-linear` matches every linear layer but the output heads), freezes every
/// other parameter (requires_grad false) and returns the adapted modules' names. Throws, before
/// changing anything, when `root` is not `adaptable`, already has adapters, `o.rank` is 0, or a
/// pattern matches no linear layer (the message lists the layers there are).
inline std::vector<std::string> apply(torch::nn::Module& root, const options& o) {
  ::unirl::options::detail::validate_into(o, "lora");
  UNIRL_CHECK(o.rank >= 1, "lora::apply: lora.rank = ", o.rank, ": expected >= 1 (0 means no adapters)");
  UNIRL_CHECK(dynamic_cast<const adaptable*>(&root) != nullptr, "lora::apply: the network ", root.name(),
              " does not run its linear layers through lora::forward (it is not a lora::adaptable); expected the "
              "built-in GPT, a Hugging Face decoder (hf::causal_lm) or a flow net");
  UNIRL_CHECK(!has_adapters(root), "lora::apply: the network already has adapters; merge them (lora::merge) first");
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> linears;
  for (const auto& m : root.named_modules("", /*include_self=*/false))
    if (detail::linear_weight(*m.value()).first.defined() && !detail::is_head(m.key()))
      linears.emplace_back(m.key(), m.value());
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  for (const auto& pattern : o.targets) {
    std::size_t hits = 0;
    for (const auto& [name, m] : linears)
      if (pattern == "all-linear" || detail::matches(name, pattern)) {
        ++hits;
        if (std::none_of(chosen.begin(), chosen.end(), [&](const auto& c) { return c.first == name; }))
          chosen.emplace_back(name, m);
      }
    if (hits == 0) {
      std::set<std::string> lasts;
      for (const auto& [name, m] : linears)
        lasts.insert(name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1));
      std::string known;
      for (const auto& l : lasts) known += (known.empty() ? "" : ", ") + l;
      throw config_error("lora.targets", "pattern \"" + pattern +
                                             "\" matches no linear layer of the network; its linear "
                                             "layers (output heads excluded) end in: " +
                                             known + " (or use all-linear)");
    }
  }
  std::sort(chosen.begin(), chosen.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  for (auto& p : root.parameters()) p.set_requires_grad(false);
  std::vector<std::string> names;
  torch::NoGradGuard ng;
  for (const auto& [name, m] : chosen) {
    const auto [w, fifo] = detail::linear_weight(*m);
    const auto in = fifo ? w.size(0) : w.size(1), out = fifo ? w.size(1) : w.size(0);
    const auto dt =
        w.scalar_type() == torch::kHalf || w.scalar_type() == torch::kBFloat16 ? torch::kFloat : w.scalar_type();
    factor a(o.rank, in, o.alpha, o.rank, o.dropout, fifo), b(out, o.rank, o.alpha, o.rank, o.dropout, fifo);
    a->to(w.device(), dt);
    b->to(w.device(), dt);
    // As LibTorch's (and PyTorch's) linear layer, as PEFT initialises lora_A: kaiming_uniform(a = sqrt(5)),
    // i.e. U(-1/sqrt(in), 1/sqrt(in)); lora_B zero.
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    a->weight.uniform_(-bound, bound);
    m->register_module("lora_A", a);
    m->register_module("lora_B", b);
    names.push_back(name);
  }
  return names;
}

/// `apply` on a model adapter's network (`model.net()`: gpt, hf::causal_lm, flow_model, ...).
template <class M>
requires requires(M& m) { *m.net(); }
std::vector<std::string> apply(M& model, const options& o) { return ::unirl::lora::apply(*model.net(), o); }

/// The adapter's weight update of module `m`, shaped like its weight: (alpha / r) B A, transposed
/// for a fan-in-fan-out layer; float32 (or the adapter's dtype). Undefined without an adapter.
inline torch::Tensor delta_weight(const torch::nn::Module& m) {
  const auto [a, b] = detail::factors_of(m);
  if (!a) return {};
  const auto d = torch::matmul(b->weight, a->weight) * a->scaling();
  return a->fan_in_fan_out() ? d.t() : d;
}

/// The named parameters of `root` as a model without adapters would have them: each adapted
/// weight merged (W + delta, added in float32 and rounded once to W's dtype), the adapters left
/// out. What `hf::save_pretrained` writes for a model with adapters. Detached.
inline named_tensors merged_parameters(const torch::nn::Module& root) {
  torch::NoGradGuard ng;
  std::map<std::string, torch::Tensor> deltas;
  for (const auto& [name, m] : adapted_modules(root))
    deltas[name.empty() ? "weight" : name + ".weight"] = delta_weight(*m);
  named_tensors out;
  for (const auto& p : root.named_parameters()) {
    const auto& key = p.key();
    if (key.find(".lora_A.") != std::string::npos || key.find(".lora_B.") != std::string::npos) continue;
    const auto it = deltas.find(key);
    if (it == deltas.end()) {
      out.emplace_back(key, p.value().detach());
      continue;
    }
    const auto w = p.value().detach();
    const auto wide = w.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
    out.emplace_back(key, (w.to(wide) + it->second.to(wide)).to(w.scalar_type()));
  }
  return out;
}

/// Folds every adapter into its base weight (W += delta, in float32, rounded once), removes the
/// adapters and makes every parameter trainable again: `root` becomes a plain model whose
/// forward equals the adapted one's (to rounding).
inline void merge(torch::nn::Module& root) {
  torch::NoGradGuard ng;
  for (const auto& [name, m] : adapted_modules(root)) {
    auto [w, fifo] = detail::linear_weight(*m);
    (void)fifo;
    const auto wide = w.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
    w.copy_((w.to(wide) + delta_weight(*m).to(wide)).to(w.scalar_type()));
    m->unregister_module("lora_A");
    m->unregister_module("lora_B");
  }
  for (auto& p : root.parameters()) p.set_requires_grad(true);
}
template <class M>
requires requires(M& m) { *m.net(); }
void merge(M& model) { ::unirl::lora::merge(*model.net()); }

/// A deep copy of `root` (as `Cloneable::clone`) that keeps its adapters and each parameter's
/// requires_grad. LibTorch's clone rebuilds a module with its `reset()`, which knows nothing of
/// adapters attached later, so they are detached for the copy and attached to both afterwards.
inline std::shared_ptr<torch::nn::Module> clone(torch::nn::Module& root,
                                                const c10::optional<torch::Device>& device = c10::nullopt) {
  const auto adapted = adapted_modules(root);
  if (adapted.empty()) return root.clone(device);
  struct held {
    std::string name;
    std::shared_ptr<torch::nn::Module> owner, a, b;
  };
  std::vector<held> hs;
  for (const auto& [name, m] : adapted) {
    const auto kids = m->children();
    hs.push_back({name, m, kids[0], kids[1]});
  }
  for (auto& h : hs) {
    h.owner->unregister_module("lora_A");
    h.owner->unregister_module("lora_B");
  }
  auto reattach = [&] {
    for (auto& h : hs) {
      h.owner->register_module("lora_A", h.a);
      h.owner->register_module("lora_B", h.b);
    }
  };
  std::shared_ptr<torch::nn::Module> copy;
  try {
    copy = root.clone(device);
  } catch (...) {
    reattach();
    throw;
  }
  reattach();
  auto mods = copy->named_modules("", /*include_self=*/false);
  for (const auto& h : hs) {
    auto target = mods[h.name];
    target->register_module("lora_A", h.a->clone(device));
    target->register_module("lora_B", h.b->clone(device));
  }
  const auto src = root.named_parameters();
  for (auto& p : copy->named_parameters()) p.value().set_requires_grad(src[p.key()].requires_grad());
  return copy;
}

/// How `save_adapter` describes the adapter in adapter_config.json.
struct adapter_options {
  std::string base_model_name_or_path{};  // the base model's id or directory (PEFT loads it from there)
  std::string task_type = "CAUSAL_LM";    // PEFT's task_type; empty: null
};

/// Writes the adapters of `root` in PEFT's layout: `dir/adapter_model.safetensors` (tensors
/// `base_model.model.<module>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r), metadata
/// format "pt") and `dir/adapter_config.json` (peft_type LORA, r, lora_alpha, lora_dropout,
/// target_modules — the adapted modules' last name components when those select exactly them,
/// else their full names — fan_in_fan_out, bias "none", ...). Throws when `root` has no adapters.
inline void save_adapter(const torch::nn::Module& root, const std::filesystem::path& dir,
                         const adapter_options& o = {}) {
  const auto adapted = adapted_modules(root);
  UNIRL_CHECK(!adapted.empty(), "lora::save_adapter: the network has no adapters (lora::apply attaches them)");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  UNIRL_CHECK(std::filesystem::is_directory(dir), "lora::save_adapter: cannot create the directory ", dir.string(),
              ec ? ": " + ec.message() : std::string());
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  const auto [a0, b0] = detail::factors_of(*adapted.front().second);
  (void)b0;
  bool fifo = false;
  std::set<std::string> lasts, names;
  for (const auto& [name, m] : adapted) {
    const auto [a, b] = detail::factors_of(*m);
    UNIRL_CHECK(a->rank() == a0->rank() && a->alpha() == a0->alpha() && a->dropout() == a0->dropout(),
                "lora::save_adapter: module ", name, " has rank ", a->rank(), " and alpha ", a->alpha(), "; module ",
                adapted.front().first, " rank ", a0->rank(), " and alpha ", a0->alpha(),
                ": expected one setting for all (PEFT's rank_pattern is not written)");
    fifo = fifo || a->fan_in_fan_out();
    tensors.emplace_back("base_model.model." + name + ".lora_A.weight",
                         a->weight.detach().to(torch::kCPU).contiguous());
    tensors.emplace_back("base_model.model." + name + ".lora_B.weight",
                         b->weight.detach().to(torch::kCPU).contiguous());
    lasts.insert(name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1));
    names.insert(name);
  }
  // PEFT matches target_modules by name suffix over every module: the short names do when they
  // select exactly the adapted modules (all of them linear), else the full names are written.
  bool exact = true;
  for (const auto& m : root.named_modules("", /*include_self=*/false)) {
    const bool hit =
        std::any_of(lasts.begin(), lasts.end(), [&](const auto& l) { return detail::matches(m.key(), l); });
    if (hit != (names.count(m.key()) > 0)) exact = false;
  }
  const auto& targets = exact ? lasts : names;
  io::save_safetensors(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}});
  nlohmann::json j{
      {"peft_type", "LORA"},
      {"auto_mapping", nullptr},
      {"base_model_name_or_path",
       o.base_model_name_or_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(o.base_model_name_or_path)},
      {"revision", nullptr},
      {"task_type", o.task_type.empty() ? nlohmann::json(nullptr) : nlohmann::json(o.task_type)},
      {"inference_mode", true},
      {"r", a0->rank()},
      {"target_modules", std::vector<std::string>(targets.begin(), targets.end())},
      {"lora_alpha", a0->alpha()},
      {"lora_dropout", a0->dropout()},
      {"fan_in_fan_out", fifo},
      {"bias", "none"},
      {"use_rslora", false},
      {"modules_to_save", nullptr},
      {"init_lora_weights", true},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"use_dora", false}};
  std::ofstream out(dir / "adapter_config.json");
  out << j.dump(2) << "\n";
  UNIRL_CHECK(out.good(), "lora::save_adapter: cannot write ", (dir / "adapter_config.json").string());
}
template <class M>
requires requires(const M& m) { *m.net(); }
void save_adapter(const M& model, const std::filesystem::path& dir, const adapter_options& o = {}) {
  ::unirl::lora::save_adapter(*model.net(), dir, o);
}

/// Bytes of a model's parameters, split into those that train and those that are frozen.
struct parameter_bytes {
  std::int64_t trainable = 0, frozen = 0;
};
inline parameter_bytes count_bytes(const torch::nn::Module& root) {
  parameter_bytes b;
  for (const auto& p : root.parameters())
    (p.requires_grad() ? b.trainable : b.frozen) += p.numel() * static_cast<std::int64_t>(p.element_size());
  return b;
}

}  // namespace unirl::lora

BOOST_HANA_ADAPT_STRUCT(unirl::lora::adapter_options, base_model_name_or_path, task_type);
