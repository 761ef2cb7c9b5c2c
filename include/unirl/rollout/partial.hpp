#pragma once
/// \file partial.hpp
/// Partial rollouts (docs/rollout-engine.md, "Partial rollouts"): token completions drawn on one
/// rollout engine that lives across draws and weight versions. A draw is given over-sampled
/// prompts (say 2B for a batch of B groups, `partial_options::batch_groups` = B): it tops the
/// groups live up to the number of prompts given — the groups still in flight from earlier draws
/// first, then new ones from the first prompts (the rest are not drawn; counted) — and returns as
/// soon as B groups have finished, the first to finish, in that order. So a batch never waits for
/// the longest sequence: the others stay in flight and finish in a later draw. Between engine steps
/// the draw asks `poll` for the newest weights (the split mode's sampler fetches them in place),
/// so sequences in flight go on under new weights. Every token records the version it was drawn
/// with (`token_rollout::token_version`); a group whose oldest token falls more than
/// `max_token_age` versions behind the newest is dropped and drawn again from its prompt (with a
/// new seed), so no batch holds a token older than that. With `recompute_kv` (the default) a
/// weight update makes the sequences in flight prefill their tokens again under the new weights,
/// so each token's behaviour log-prob is exactly the log-prob of the weights its version names
/// (tested in float64); without it they keep the keys and values of the weights that computed
/// them (no recompute; a token's log-prob then mixes versions).
///
/// ```cpp
/// unirl::rollout::partial_rollouts carry{{.max_token_age = 1}, [&] { return fetch_newest(); }};
/// torch::NoGradGuard ng;
/// auto batch = carry.draw(model, prompts, /*group_size=*/8, {.max_new_tokens = 256});
/// carry.last().oldest_version;   // the batch's oldest token: its staleness counts from here
/// ```
///
/// The GRPO family draws through it when `step_info::partial` is set (`algo::draw_completions`);
/// `parallel::rollout_worker` sets it with `worker_options::partial_rollouts`.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <typeindex>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>
#include <unirl/rollout/engine.hpp>
#include <unirl/rollout/engine_sampler.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>

namespace unirl::rollout {

/// Settings of `partial_rollouts`.
struct partial_options {
  /// At a weight update the sequences in flight prefill their tokens again under the new weights
  /// (each token's behaviour log-prob is then its version's exactly); false keeps their keys and
  /// values (no recompute).
  bool recompute_kv = true;
  /// A group whose oldest token is more than this many versions behind the newest is drawn again
  /// from its prompt; < 0: never (the caller bounds staleness itself).
  std::int64_t max_token_age = 1;
  /// Groups a draw returns; 0: as many as it is given prompts (then nothing is left in flight and
  /// a batch waits for its slowest group). At most the prompts given.
  std::int64_t batch_groups = 0;
  /// The engine's sizes; its pool is sized for the first draw's prompts' groups when `kv_tokens` is 0.
  engine_options engine{.kv_tokens = 0};
};

/// What the last `draw` did (host counts).
struct partial_figures {
  std::int64_t carried_groups = 0;       // groups returned that an earlier draw submitted
  std::int64_t new_groups = 0;           // groups this draw submitted from its prompts
  std::int64_t unused_prompts = 0;       // prompts given and not drawn (the live groups were enough)
  std::int64_t restarted_groups = 0;     // groups drawn again from their prompt (too old)
  std::int64_t mixed_samples = 0;        // samples returned whose tokens span more than one version
  std::int64_t version_changes = 0;      // weight updates taken in the draw (at its start or between steps)
  std::int64_t in_flight_groups = 0;     // groups left in flight for the next draw
  std::int64_t oldest_version = 0;       // the oldest token returned (the batch's staleness counts from it)
  std::int64_t newest_version = 0;       // the weights' version at the end of the draw
};

/// A rollout engine whose groups outlive a draw (see the file comment). Not copyable: it holds
/// the engine, which refers to the model; the same model object must be passed to every draw.
class partial_rollouts {
 public:
  /// `poll()` applies the newest weights to the model and returns their version; it is called
  /// before a draw and after each engine step. Without it `set_version` tells of updates.
  explicit partial_rollouts(partial_options o = {}, std::function<std::int64_t()> poll = {})
      : o_(std::move(o)), poll_(std::move(poll)) {}
  partial_rollouts(const partial_rollouts&) = delete;
  partial_rollouts& operator=(const partial_rollouts&) = delete;

  /// The weights are now version `v` (non-decreasing); applied at the next draw or engine step.
  void set_version(std::int64_t v) {
    UNIRL_CHECK(v >= version_, "partial_rollouts::set_version: ", v, " after ", version_,
                ": expected non-decreasing versions");
    version_ = v;
  }
  std::int64_t version() const { return version_; }
  const partial_figures& last() const { return last_; }
  /// Draws so far (a sampler that never draws through it is told so by its caller).
  std::int64_t draws() const { return draws_; }
  /// Groups submitted and not yet returned.
  std::int64_t in_flight() const { return static_cast<std::int64_t>(groups_.size()); }
  /// Groups restarted so far.
  std::int64_t restarts() const { return restarts_; }
  /// Starts a span of draws (one trainer step may draw more than once: dynamic sampling);
  /// `oldest_since_mark()` is then the oldest token any of them returned.
  void mark() { oldest_mark_ = std::numeric_limits<std::int64_t>::max(); }
  std::int64_t oldest_since_mark() const {
    return oldest_mark_ == std::numeric_limits<std::int64_t>::max() ? version_ : oldest_mark_;
  }

  /// `batch_groups` groups of `group_size` completions (see the file comment): the first to finish
  /// among those in flight and the new ones from `in`, in the order they finished, laid out as
  /// `sample_tokens_engine` lays them out plus `token_version`. New groups' seeds come from
  /// LibTorch's default generator; `group_size`, the sampling options and the model must be those
  /// of the first draw. Call under `torch::NoGradGuard`.
  template <PagedCausalLM M>
  token_rollout draw(const M& model, const prompt_batch& in, std::int64_t group_size, const sampling_options& s,
                     torch::Device device = torch::kCPU, engine_summary* summary = nullptr) {
    s.validate("sampling.");
    UNIRL_CHECK(s.engine, "partial_rollouts: sampling.engine = false: partial rollouts run on the rollout engine");
    UNIRL_CHECK(in.texts.empty() || in.texts.size() == in.tokens.size(), "partial_rollouts: ", in.texts.size(),
                " prompt texts for ", in.tokens.size(), " prompts");
    UNIRL_CHECK(in.references.empty() || in.references.size() == in.tokens.size(), "partial_rollouts: ",
                in.references.size(), " references for ", in.tokens.size(), " prompts");
    (void)pad_prompts(in, group_size);  // checks the prompts and group_size before any work
    const auto B = o_.batch_groups > 0 ? o_.batch_groups : in.size();
    UNIRL_CHECK(B <= in.size(), "partial_rollouts: batch_groups = ", B, " but ", in.size(),
                " prompts given: expected at least batch_groups prompts (over-sampled: say twice as many)");
    auto& eng = engine_for(model, in, group_size, s);
    const auto before = eng.stats();
    last_ = {};
    apply_version(eng);
    const auto fresh = std::max<std::int64_t>(0, in.size() - in_flight());
    last_.new_groups = fresh;
    last_.unused_prompts = in.size() - fresh;
    const auto seeds =
        torch::randint(0, std::numeric_limits<std::int64_t>::max(), {std::max<std::int64_t>(fresh, 1)}, torch::kInt64);
    const auto* sp = seeds.data_ptr<std::int64_t>();
    for (std::int64_t p = 0; p < fresh; ++p) {
      const auto i = static_cast<std::size_t>(p);
      group g{.prompt = in.tokens[i], .text = in.texts.empty() ? std::string{} : in.texts[i],
              .reference = in.references.empty() ? std::string{} : in.references[i],
              .seed = static_cast<std::uint64_t>(sp[p]), .draw = draws_};
      submit(eng, g);
      const auto id = next_group_++;
      by_request_[g.request] = id;
      groups_.emplace(id, std::move(g));
    }
    engine_summary sum;
    while (static_cast<std::int64_t>(finished_.size()) < B) {
      UNIRL_CHECK(eng.has_work(), "partial_rollouts: ", finished_.size(), " groups finished of ", B,
                  " and nothing in flight");
      for (auto& r : eng.step()) {
        const auto it = by_request_.find(r.request);
        if (it == by_request_.end()) continue;  // a restarted group's old request
        auto& g = groups_.at(it->second);
        g.done[static_cast<std::size_t>(r.sample)] = std::move(r);
        if (++g.finished == group_size_) finished_.push_back(it->second);
      }
      const auto& st = eng.stats();
      sum.peak_blocks = std::max(sum.peak_blocks, st.used_blocks);
      sum.peak_kv_bytes = std::max(sum.peak_kv_bytes, st.kv_bytes);
      if (poll_) apply_version(eng);
    }
    sum.steps = eng.stats().steps - before.steps;
    sum.prefix_hit_tokens = eng.stats().prefix_hit_tokens - before.prefix_hit_tokens;
    sum.preemptions = eng.stats().preemptions - before.preemptions;
    if (summary) *summary = sum;

    // The first B groups to finish, in that order.
    prompt_batch out_in{.decode = in.decode, .pad_id = in.pad_id};
    std::vector<result> by_sample;
    by_sample.reserve(static_cast<std::size_t>(B * group_size_));
    bool texts = true, references = true;
    std::int64_t oldest = std::numeric_limits<std::int64_t>::max();
    for (std::int64_t k = 0; k < B; ++k) {
      const auto id = finished_.front();
      finished_.pop_front();
      auto& g = groups_.at(id);
      out_in.tokens.push_back(g.prompt);
      out_in.texts.push_back(g.text);
      out_in.references.push_back(g.reference);
      texts = texts && !g.text.empty();
      references = references && !g.reference.empty();
      if (g.draw < draws_) ++last_.carried_groups;
      for (auto& r : g.done) {
        if (!r.versions.empty()) {
          const auto [lo, hi] = std::minmax_element(r.versions.begin(), r.versions.end());
          oldest = std::min(oldest, *lo);
          if (*lo != *hi) ++last_.mixed_samples;
        }
        by_sample.push_back(std::move(r));
      }
      by_request_.erase(g.request);
      groups_.erase(id);
    }
    if (!texts) out_in.texts.clear();
    if (!references) out_in.references.clear();
    last_.oldest_version = oldest == std::numeric_limits<std::int64_t>::max() ? version_ : oldest;
    oldest_mark_ = std::min(oldest_mark_, last_.oldest_version);
    last_.newest_version = version_;
    last_.in_flight_groups = in_flight();
    ++draws_;
    auto [pids, pmask] = pad_prompts(out_in, group_size_);
    const auto lp_dtype = eng.dtype() == torch::kDouble ? torch::kDouble : torch::kFloat;
    return detail::assemble_rollout(out_in, pids, pmask, group_size_, by_sample, s, device, lp_dtype, true);
  }

 private:
  struct group {
    std::vector<std::int64_t> prompt;
    std::string text, reference;
    std::uint64_t seed = 0;
    std::int64_t draw = 0;      // the draw that submitted it
    std::int64_t request = -1;  // its engine request
    std::vector<result> done{};
    std::int64_t finished = 0;
  };

  // The engine of the first draw (made then), for the same model, group size and sampling.
  template <PagedCausalLM M>
  engine<M>& engine_for(const M& model, const prompt_batch& in, std::int64_t group_size, const sampling_options& s) {
    if (!engine_) {
      auto eo = o_.engine;
      if (eo.kv_tokens <= 0) {
        std::int64_t P = 0;
        for (const auto& t : in.tokens) P = std::max<std::int64_t>(P, static_cast<std::int64_t>(t.size()));
        eo = engine_options_for(in.size() * group_size, P + s.max_new_tokens, group_size, eo);
      }
      engine_ = std::make_shared<engine<M>>(model, eo);
      type_ = std::type_index(typeid(M));
      model_ = &model;
      group_size_ = group_size;
      sampling_ = s;
      return *static_cast<engine<M>*>(engine_.get());
    }
    UNIRL_CHECK(type_ == std::type_index(typeid(M)) && model_ == static_cast<const void*>(&model),
                "partial_rollouts::draw: another model than the first draw's; expected the same model object");
    UNIRL_CHECK(group_size == group_size_, "partial_rollouts::draw: group_size = ", group_size,
                ": expected the first draw's ", group_size_, " (its groups are still in flight)");
    UNIRL_CHECK(s.max_new_tokens == sampling_.max_new_tokens && s.temperature == sampling_.temperature &&
                    s.top_k == sampling_.top_k && s.top_p == sampling_.top_p && s.stop_tokens == sampling_.stop_tokens,
                "partial_rollouts::draw: sampling options (max_new_tokens ", s.max_new_tokens, ", temperature ",
                s.temperature, ", top_k ", s.top_k, ", top_p ", s.top_p,
                ", stop tokens) differ from the first draw's: expected the same (its groups are still in flight)");
    return *static_cast<engine<M>*>(engine_.get());
  }

  template <class E>
  void submit(E& eng, group& g) {
    g.request = eng.submit({.prompt = g.prompt, .sampling = sampling_, .seed = g.seed, .n = group_size_});
    g.done.assign(static_cast<std::size_t>(group_size_), result{});
    g.finished = 0;
  }

  // Takes the newest version (poll or set_version) into the engine and, when it changed, draws
  // again the groups whose oldest token is now too old.
  template <class E>
  void apply_version(E& eng) {
    if (poll_) {
      const auto v = poll_();
      if (v > version_) version_ = v;
    }
    // A group's age changes only with the version (its first token's version is fixed): the scan
    // below runs once per update, not after every engine step.
    if (version_ == eng.weight_version()) return;
    if (draws_ > 0 || eng.stats().steps > 0) ++last_.version_changes;
    eng.set_weight_version(version_, o_.recompute_kv);
    if (o_.max_token_age < 0) return;
    for (auto& [id, g] : groups_) {
      const auto first = eng.first_draw_version(g.request);
      if (first < 0 || first >= version_ - o_.max_token_age) continue;
      (void)eng.abort(g.request);
      by_request_.erase(g.request);
      finished_.erase(std::remove(finished_.begin(), finished_.end(), id), finished_.end());
      g.seed = mix(g.seed);
      submit(eng, g);
      by_request_[g.request] = id;
      ++last_.restarted_groups;
      ++restarts_;
    }
  }

  static std::uint64_t mix(std::uint64_t x) {  // splitmix64
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

  partial_options o_;
  std::function<std::int64_t()> poll_;
  std::shared_ptr<void> engine_;
  std::type_index type_{typeid(void)};
  const void* model_ = nullptr;
  std::int64_t group_size_ = 0;
  sampling_options sampling_{};
  std::int64_t version_ = 0;
  std::int64_t oldest_mark_ = std::numeric_limits<std::int64_t>::max();
  std::int64_t draws_ = 0, restarts_ = 0, next_group_ = 0;
  std::map<std::int64_t, group> groups_;              // by group id, in submission order
  std::map<std::int64_t, std::int64_t> by_request_;   // engine request -> group id
  std::deque<std::int64_t> finished_;                 // finished groups not yet returned, in order
  partial_figures last_{};
};

}  // namespace unirl::rollout
