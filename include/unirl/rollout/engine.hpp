#pragma once
/// \file engine.hpp
/// The rollout engine: continuous batching over a paged KV cache for any `PagedCausalLM`.
/// Requests (a prompt, sampling options, a seed, stop tokens and strings, a token limit, a group
/// size n) wait in a queue; each `step()` runs ONE forward over a mixed batch of decode tokens and
/// prefill chunks under a token budget (`max_batch_tokens`, chunked prefill) with at most
/// `max_sequences` live; a finished sequence leaves at once and a waiting one takes its place.
/// Results come back as they finish, with their behaviour log-probs. Design: docs/rollout-engine.md.
///
/// ```cpp
/// unirl::rollout::engine eng{model, {.max_sequences = 32, .max_batch_tokens = 256}};
/// eng.submit({.prompt = {1, 5, 2}, .sampling = {.max_new_tokens = 64, .stop_tokens = {eos}}, .seed = 7, .n = 8});
/// for (const auto& r : eng.run()) use(r.tokens, r.logp);   // 8 completions sharing the prompt's blocks
/// ```
///
/// - Blocks: a sequence's keys and values live in `block_size`-token blocks of one pool (block
///   tables, `rollout::block_pool`), allocated as it grows and freed when it finishes. A request
///   with n > 1 is prefilled once; its n samples share the prompt's blocks (reference counts) and
///   a shared partial last block is copied on write.
/// - Prefix cache: a full block is remembered by its content (the tokens so far) and the weights'
///   version; a later request with the same prefix takes those blocks instead of prefilling them.
///   `set_weight_version` forgets them all, so a stale prefix is never served.
/// - Streams: each sample draws from its own generator seeded from (seed, sample index), so its
///   tokens do not depend on the batch around it or the arrival order.
/// - Pause / resume: with `pause_at_stop_string`, a sample that emits a stop string ends its turn
///   (reason `paused`) and keeps its blocks; `resume(sequence, tokens)` appends tokens (a tool's
///   reply) and continues without prefilling its past again; `release` frees a paused sequence.
/// - Preemption: when the pool runs out, the latest admitted sequence gives its blocks back and
///   is recomputed later (its tokens, log-probs and generator are kept).
/// - Host reads: one per step that samples (the tokens, their log-probs and a NaN flag).
#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rollout/kv_pool.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/rollout/token_sampler.hpp>

namespace unirl::rollout {

/// Sizes of an `engine`.
struct engine_options {
  std::int64_t block_size = 16;         // token slots per KV block
  std::int64_t kv_tokens = 16384;       // pool capacity in tokens (rounded up to blocks)
  std::int64_t max_sequences = 64;      // live sequences at most (a request of n counts n)
  std::int64_t max_batch_tokens = 512;  // tokens per forward (decode tokens + prefill chunks)
  bool prefix_cache = true;             // reuse full blocks of equal prefixes across requests
  bool keep_logits = false;             // results carry the logits of each sampled position

  void validate(const std::string& p) const {
    options::require(block_size >= 1, p + "block_size", block_size, ">= 1");
    options::require(kv_tokens >= block_size, p + "kv_tokens", kv_tokens, ">= block_size");
    options::require(max_sequences >= 1, p + "max_sequences", max_sequences, ">= 1");
    options::require(max_batch_tokens >= 1, p + "max_batch_tokens", max_batch_tokens, ">= 1");
  }
};

/// One request: `n` completions of `prompt`, each at most `sampling.max_new_tokens` tokens per
/// turn, stopping at `sampling.stop_tokens` (kept) or at a stop string of the decoded turn.
struct request {
  std::vector<std::int64_t> prompt;
  sampling_options sampling{};
  std::uint64_t seed = 0;
  std::int64_t n = 1;
  std::vector<std::string> stop_strings{};  // need the engine's decoder
  bool pause_at_stop_string = false;        // a stop string ends the turn and keeps the blocks
};

/// Why a sample left the batch.
enum class finish_reason { stop_token, stop_string, length, paused };

/// A sample's turn: the tokens it generated in this turn and their behaviour log-probs (of the
/// temperature-scaled distribution before top-k / top-p, as `sample_tokens` records them).
struct result {
  std::int64_t request = 0;   // the id `submit` returned
  std::int64_t sample = 0;    // in [0, n)
  std::int64_t sequence = 0;  // the id `resume` / `release` take (paused samples)
  std::vector<std::int64_t> tokens;
  std::vector<double> logp;
  std::vector<std::int64_t> versions;  // the weight version (`set_weight_version`) each token was drawn with
  finish_reason reason = finish_reason::length;
  torch::Tensor logits{};     // (tokens, V) with `keep_logits`
};

/// What one step did, and the pool after it.
struct engine_stats {
  std::int64_t tokens = 0, decode_tokens = 0, prefill_tokens = 0;  // rows of this step's forward
  std::int64_t sampled = 0;                                        // samples drawn in this step
  std::int64_t running = 0, waiting = 0, paused = 0;
  std::int64_t used_blocks = 0, kv_bytes = 0;  // blocks with a reference, their bytes
  std::int64_t live_token_blocks = 0;          // sum over live sequences of their tokens in blocks (no sharing)
  std::int64_t prefix_hit_tokens = 0;          // tokens served by the prefix cache so far
  std::int64_t preemptions = 0;                // so far
  std::int64_t steps = 0;                      // so far
};

template <PagedCausalLM M>
class engine {
 public:
  engine(const M& model, engine_options o = {}, token_decoder decode = {})
      : model_(model), o_(o), decode_(std::move(decode)),
        pool_((o.validate("engine."), (o.kv_tokens + o.block_size - 1) / o.block_size), o.block_size) {
    kv_ = model_.make_paged_kv(pool_.blocks() * o_.block_size);
    for (std::size_t l = 0; l < kv_.k.size(); ++l)
      slot_bytes_ += (kv_.k[l].numel() + kv_.v[l].numel()) / kv_.slots * kv_.k[l].element_size();
  }

  /// Queues a request; returns its id. Errors name the bad value before any work.
  std::int64_t submit(request r) {
    r.sampling.validate("engine: request.sampling.");
    UNIRL_CHECK(!r.prompt.empty(), "engine: the request's prompt is empty; every prompt needs a token");
    UNIRL_CHECK(r.n >= 1, "engine: request.n = ", r.n, ": expected >= 1");
    UNIRL_CHECK(r.n <= o_.max_sequences, "engine: request.n = ", r.n, " exceeds max_sequences = ", o_.max_sequences,
                " (a group enters the batch whole)");
    check_ids(r.prompt, "prompt");
    for (const auto& s : r.stop_strings) UNIRL_CHECK(!s.empty(), "engine: a stop string is empty; expected text");
    UNIRL_CHECK(r.stop_strings.empty() || static_cast<bool>(decode_), "engine: stop strings need a decoder (engine(",
                "model, options, decode))");
    check_fits(static_cast<std::int64_t>(r.prompt.size()), r.sampling.max_new_tokens);
    const auto id = static_cast<std::int64_t>(requests_.size());
    auto s = std::make_unique<sequence>();
    s->id = next_seq_++;
    s->request = id;
    s->tokens = r.prompt;
    s->turn_start = static_cast<std::int64_t>(r.prompt.size());
    s->fork = r.n;
    s->max_new = r.sampling.max_new_tokens;
    requests_.push_back(std::move(r));
    first_draw_.push_back(-1);
    waiting_.push_back(s.get());
    seqs_.emplace(s->id, std::move(s));
    return id;
  }

  /// Continues a paused sequence with `tokens` appended (a tool's reply; may be empty) for up to
  /// `max_new_tokens` more tokens (0: its request's limit). Its past is not prefilled again.
  void resume(std::int64_t seq, const std::vector<std::int64_t>& tokens, std::int64_t max_new_tokens = 0) {
    auto& s = paused(seq, "resume");
    check_ids(tokens, "resumed");
    const auto limit = max_new_tokens > 0 ? max_new_tokens : requests_[static_cast<std::size_t>(s.request)].sampling.max_new_tokens;
    check_fits(static_cast<std::int64_t>(s.tokens.size() + tokens.size()), limit);
    s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
    s.turn_start = static_cast<std::int64_t>(s.tokens.size());
    s.max_new = limit;
    s.st = state::running;
    s.logp.clear();
    s.versions.clear();
    s.logits.clear();
    running_.push_back(&s);
  }
  /// Frees a paused sequence's blocks.
  void release(std::int64_t seq) {
    auto& s = paused(seq, "release");
    pool_.release(s.table);
    seqs_.erase(seq);
  }

  /// The weights changed: every cached prefix is forgotten (never served under other weights).
  /// Sequences in flight keep their keys and values, or with `recompute` give their blocks back
  /// and prefill their tokens again under the new weights (the running ones at their next
  /// schedule, a paused one when resumed): each later token is then the new weights' draw
  /// exactly. Their tokens, log-probs, versions and generators are kept.
  void set_weight_version(std::int64_t v, bool recompute = false) {
    if (v == version_) return;
    version_ = v;
    pool_.clear_cache();
    for (auto& [id, s] : seqs_) s->cacheable = false;
    if (!recompute) return;
    while (!running_.empty()) preempt(*running_.back(), false);  // back first: the waiting order stays
    for (auto& [id, s] : seqs_)
      if (s->st == state::paused) forget_blocks(*s);
  }

  /// The first weight version a token of request `id` was drawn with (its group's oldest token);
  /// -1 while none is drawn.
  std::int64_t first_draw_version(std::int64_t id) const {
    UNIRL_CHECK(id >= 0 && id < static_cast<std::int64_t>(requests_.size()), "engine::first_draw_version: request ",
                id, " was never submitted");
    return first_draw_[static_cast<std::size_t>(id)];
  }

  /// Drops request `id`: its waiting, running and paused samples leave and their blocks are
  /// freed; results already returned stay valid. False when nothing of it was left.
  bool abort(std::int64_t id) {
    UNIRL_CHECK(id >= 0 && id < static_cast<std::int64_t>(requests_.size()), "engine::abort: request ", id,
                " was never submitted");
    std::vector<std::int64_t> gone;
    for (auto& [sid, s] : seqs_)
      if (s->request == id) gone.push_back(sid);
    for (const auto sid : gone) {
      auto& s = *seqs_.at(sid);
      if (s.st == state::running) running_.erase(std::find(running_.begin(), running_.end(), &s));
      if (s.st == state::waiting) waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &s));
      pool_.release(s.table);
      seqs_.erase(sid);
    }
    return !gone.empty();
  }
  std::int64_t weight_version() const { return version_; }

  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  const engine_stats& stats() const { return stats_; }
  const block_pool& pool() const { return pool_; }
  std::int64_t slot_bytes() const { return slot_bytes_; }
  /// The pool's dtype (the model's).
  torch::ScalarType dtype() const { return kv_.k.front().scalar_type(); }

  /// Steps until no request waits or runs; every result in the order they finished.
  std::vector<result> run() {
    std::vector<result> all;
    while (has_work()) {
      auto r = step();
      for (auto& x : r) all.push_back(std::move(x));
    }
    return all;
  }

  /// One forward over the scheduled tokens, then one sampling of the sequences whose known
  /// tokens are all computed; returns the samples that finished or paused in it.
  std::vector<result> step() {
    torch::NoGradGuard ng;
    std::vector<std::pair<sequence*, std::int64_t>> chosen;  // (sequence, tokens this step)
    schedule(chosen);
    std::vector<result> out;
    ++stats_.steps;
    stats_.tokens = stats_.decode_tokens = stats_.prefill_tokens = stats_.sampled = 0;
    if (chosen.empty()) {
      UNIRL_CHECK(!has_work(), "engine: no sequence could be scheduled (", waiting_.size(), " waiting, ",
                  running_.size(), " running, ", pool_.free_blocks(), " free blocks)");
      fill_stats();
      return out;
    }
    std::vector<paged_chunk_spec> specs;
    std::vector<std::int64_t> out_rows;
    std::vector<sequence*> samplers;  // sequences sampled from this step, by output row
    std::int64_t row = 0;
    for (auto& [s, n] : chosen) {
      const auto b = s->tokens.begin() + s->computed;
      std::int64_t lead = 0;  // equal ids right before the chunk (runs of image-slot ids, paged_batch::run_index)
      for (auto p = s->computed - 1; p >= 0 && s->tokens[static_cast<std::size_t>(p)] == *b; --p) ++lead;
      specs.push_back({std::vector<std::int64_t>(b, b + n), s->computed, &s->table, lead});
      row += n;
      (n == 1 ? stats_.decode_tokens : stats_.prefill_tokens) += n;
      if (s->computed + n == static_cast<std::int64_t>(s->tokens.size())) {
        out_rows.push_back(row - 1);
        samplers.push_back(s);
      }
    }
    stats_.tokens = row;
    const auto device = kv_.k.front().device();
    const auto batch = make_paged_batch(specs, o_.block_size, out_rows, device);
    torch::Tensor logits;
    if (!out_rows.empty()) logits = model_.logits_paged(batch, kv_);
    else {
      auto prefill_only = batch;
      prefill_only.output_rows = torch::empty({0}, torch::TensorOptions(torch::kInt64).device(device));
      (void)model_.logits_paged(prefill_only, kv_);
    }
    for (auto& [s, n] : chosen) {
      s->computed += n;
      remember_blocks(*s);
    }
    if (!out_rows.empty()) sample(logits, samplers, out);
    fill_stats();
    return out;
  }

 private:
  enum class state { waiting, running, paused };
  struct sequence {
    std::int64_t id = 0, request = 0, sample = 0;
    std::vector<std::int64_t> tokens;  // everything so far: prompt, generated, appended
    std::int64_t computed = 0;         // tokens whose keys and values are in the pool
    std::int64_t turn_start = 0;       // where this turn's generated tokens start
    std::int64_t max_new = 0;          // this turn's limit
    std::int64_t fork = 1;             // > 1: a group's prompt, forked into `fork` samples at its first draw
    std::vector<std::int32_t> table;
    std::vector<std::int64_t> block_keys;  // prefix-cache ids of the first `keyed` full blocks
    std::int64_t keyed = 0;
    std::vector<double> logp;
    std::vector<std::int64_t> versions;
    std::vector<torch::Tensor> logits;
    at::Generator gen;
    state st = state::waiting;
    bool cacheable = true;  // false once the weights changed under it: its blocks hold old keys
  };

  // Input ids are in [0, vocab_size), or [0, input_vocab_size()) for a model that takes more
  // ids than it predicts (a VLM's image-slot ids).
  void check_ids(const std::vector<std::int64_t>& ids, const char* what) const {
    if constexpr (requires { model_.input_vocab_size(); }) {
      const auto V = model_.input_vocab_size();
      for (const auto t : ids)
        UNIRL_CHECK(t >= 0 && t < V, "engine: ", what, " token id ", t, " is outside [0, input_vocab_size = ", V,
                    ") (the vocabulary, then the ids of the images registered)");
    } else {
      const auto V = model_.vocab_size();
      for (const auto t : ids)
        UNIRL_CHECK(t >= 0 && t < V, "engine: ", what, " token id ", t, " is outside [0, vocab_size = ", V, ")");
    }
  }
  void check_fits(std::int64_t tokens, std::int64_t max_new) const {
    const auto ctx = static_cast<std::int64_t>(model_.max_length());
    UNIRL_CHECK(tokens + max_new <= ctx, "engine: a request of ", tokens, " tokens plus max_new_tokens = ", max_new,
                " is longer than the model's context (", ctx, " tokens)");
    const auto need = pool_.blocks_for(tokens + max_new);
    UNIRL_CHECK(need <= pool_.blocks(), "engine: a sequence of ", tokens + max_new, " tokens needs ", need,
                " blocks of ", o_.block_size, "; the pool has ", pool_.blocks(), " (raise kv_tokens to at least ",
                need * o_.block_size, ")");
  }
  sequence& paused(std::int64_t seq, const char* what) {
    const auto it = seqs_.find(seq);
    UNIRL_CHECK(it != seqs_.end() && it->second->st == state::paused, "engine::", what, ": sequence ", seq,
                " is not paused");
    return *it->second;
  }
  std::int64_t seats(const sequence& s) const { return s.fork; }

  // Makes sequence s's blocks cover `upto` tokens, copying a shared partial block it writes
  // into first; false when the pool is out of blocks.
  bool reserve(sequence& s, std::int64_t upto) {
    const auto bs = o_.block_size;
    if (s.computed % bs != 0) {
      const auto i = static_cast<std::size_t>(s.computed / bs);
      const auto b = s.table[i];
      if (pool_.refs(b) > 1) {
        if (pool_.free_blocks() < 1 + pool_.blocks_for(upto) - static_cast<std::int64_t>(s.table.size())) return false;
        const auto fresh = *pool_.allocate();
        copy_block(kv_, b, fresh, bs);
        std::vector<std::int32_t> one{b};
        pool_.release(one);
        s.table[i] = fresh;
      }
    }
    return pool_.grow(s.table, upto);
  }
  // Gives the blocks of the latest admitted running sequence back; it is recomputed later.
  void preempt(sequence& s, bool count = true) {
    forget_blocks(s);
    s.st = state::waiting;
    running_.erase(std::find(running_.begin(), running_.end(), &s));
    waiting_.push_front(&s);
    if (count) ++stats_.preemptions;
  }
  void forget_blocks(sequence& s) {
    pool_.release(s.table);
    s.computed = 0;
    s.block_keys.clear();
    s.keyed = 0;
    s.cacheable = true;  // recomputed under the current weights
  }
  // Full blocks of a waiting sequence's known tokens found in the prefix cache (the last token is
  // always computed: its logits are needed).
  void match_prefix(sequence& s) {
    if (!o_.prefix_cache || s.computed != 0) return;
    const auto bs = o_.block_size;
    const auto full = (static_cast<std::int64_t>(s.tokens.size()) - 1) / bs;
    std::int64_t parent = 0;
    for (std::int64_t j = 0; j < full; ++j) {
      const auto key = key_of(s, j, parent);
      const auto hit = pool_.lookup(key);
      if (!hit) break;
      pool_.take(hit->first);
      s.table.push_back(hit->first);
      s.block_keys.push_back(hit->second);
      parent = hit->second;
    }
    s.keyed = static_cast<std::int64_t>(s.block_keys.size());
    s.computed = s.keyed * bs;
    stats_.prefix_hit_tokens += s.computed;
  }
  block_pool::content_key key_of(const sequence& s, std::int64_t j, std::int64_t parent) const {
    const auto b = s.tokens.begin() + j * o_.block_size;
    return {parent, version_, std::vector<std::int64_t>(b, b + o_.block_size)};
  }
  void remember_blocks(sequence& s) {
    if (!o_.prefix_cache || !s.cacheable) return;
    const auto full = s.computed / o_.block_size;
    for (; s.keyed < full; ++s.keyed) {
      const auto parent = s.keyed == 0 ? 0 : s.block_keys.back();
      s.block_keys.push_back(pool_.remember(s.table[static_cast<std::size_t>(s.keyed)], key_of(s, s.keyed, parent)));
    }
  }

  void schedule(std::vector<std::pair<sequence*, std::int64_t>>& chosen) {
    std::int64_t budget = o_.max_batch_tokens;
    for (std::size_t i = 0; i < running_.size() && budget > 0;) {
      auto& s = *running_[i];
      const auto take = std::min(static_cast<std::int64_t>(s.tokens.size()) - s.computed, budget);
      if (reserve(s, s.computed + take)) {
        chosen.emplace_back(&s, take);
        budget -= take;
        ++i;
        continue;
      }
      // Out of blocks: the latest admitted sequence not yet scheduled this step gives its back.
      preempt(*running_.back());
      if (i >= running_.size()) break;  // s itself was the latest
    }
    std::int64_t live = 0;
    for (const auto* s : running_) live += seats(*s);
    while (!waiting_.empty() && budget > 0) {
      auto& s = *waiting_.front();
      if (live + seats(s) > o_.max_sequences) break;
      match_prefix(s);
      const auto take = std::min(static_cast<std::int64_t>(s.tokens.size()) - s.computed, budget);
      if (!pool_.grow(s.table, s.computed + take)) {
        stats_.prefix_hit_tokens -= s.computed;
        pool_.release(s.table);
        s.computed = 0;
        s.block_keys.clear();
        s.keyed = 0;
        break;
      }
      waiting_.pop_front();
      s.st = state::running;
      running_.push_back(&s);
      live += seats(s);
      chosen.emplace_back(&s, take);
      budget -= take;
    }
  }

  static std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

  void sample(const torch::Tensor& logits, const std::vector<sequence*>& samplers, std::vector<result>& out) {
    // A group's prompt forks here into its n samples (sample 0 keeps the blocks' first reference).
    std::vector<sequence*> rows;
    std::vector<std::int64_t> src;
    for (std::size_t i = 0; i < samplers.size(); ++i) {
      auto* s = samplers[i];
      const auto& req = requests_[static_cast<std::size_t>(s->request)];
      if (!s->gen.defined()) {
        const auto n = s->fork;
        s->fork = 1;
        for (std::int64_t j = 0; j < n; ++j) {
          sequence* c = s;
          if (j > 0) {
            auto child = std::make_unique<sequence>(*s);
            child->id = next_seq_++;
            child->table = pool_.share(s->table);
            child->sample = j;
            c = child.get();
            running_.push_back(c);
            seqs_.emplace(c->id, std::move(child));
          }
          c->gen = at::make_generator<at::CPUGeneratorImpl>(mix(req.seed ^ mix(static_cast<std::uint64_t>(j))));
          rows.push_back(c);
          src.push_back(static_cast<std::int64_t>(i));
        }
      } else {
        rows.push_back(s);
        src.push_back(static_cast<std::int64_t>(i));
      }
    }
    const auto K = static_cast<std::int64_t>(rows.size());
    stats_.sampled = K;
    const auto dev = logits.device();
    const auto raw = K == static_cast<std::int64_t>(samplers.size())
                         ? logits
                         : logits.index_select(0, torch::tensor(src, torch::kInt64).to(dev));
    const auto lp_dtype = raw.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
    const auto V = raw.size(1);
    std::vector<double> temps(static_cast<std::size_t>(K));
    // temperature = 0 is greedy: top_k = 1 at temperature 1, as in `sample_tokens` (sampling_options).
    bool unit_temperature = true;
    for (std::int64_t i = 0; i < K; ++i) {
      const double t = spec(*rows[static_cast<std::size_t>(i)]).temperature;
      temps[static_cast<std::size_t>(i)] = t > 0.0 ? t : 1.0;
      unit_temperature = unit_temperature && temps[static_cast<std::size_t>(i)] == 1.0;
    }
    const auto as_lp = raw.to(lp_dtype);
    const auto scaled = unit_temperature ? as_lp
                                         : as_lp / torch::tensor(temps, torch::kDouble).to(dev, lp_dtype).unsqueeze(1);
    // top-k / top-p per distinct setting
    std::map<std::pair<std::int64_t, double>, std::vector<std::int64_t>> groups;
    for (std::int64_t i = 0; i < K; ++i) {
      const auto& sp = spec(*rows[static_cast<std::size_t>(i)]);
      groups[{sp.temperature > 0.0 ? sp.top_k : 1, sp.top_p}].push_back(i);
    }
    bool filtering = false;
    for (const auto& [kp, idx] : groups) filtering = filtering || (kp.first > 0 && kp.first < V) || kp.second < 1.0;
    // The behaviour log-prob is of the unfiltered distribution: without top-k / top-p the drawn
    // token's probability itself, else the log-softmax of the scaled logits.
    torch::Tensor probs, lsm;
    if (!filtering) probs = torch::softmax(scaled, -1);
    else {
      lsm = torch::log_softmax(scaled, -1);
      torch::Tensor filtered;
      if (groups.size() == 1) filtered = filter_logits(scaled, groups.begin()->first.first, groups.begin()->first.second);
      else {
        filtered = scaled.clone();
        for (const auto& [kp, idx] : groups) {
          const auto at = torch::tensor(idx, torch::kInt64).to(dev);
          filtered.index_copy_(0, at, filter_logits(scaled.index_select(0, at), kp.first, kp.second));
        }
      }
      probs = torch::softmax(filtered, -1);
    }
    // Each sample's own stream: one uniform u per draw, the token is where the cumulative
    // distribution passes u (inverse CDF: one random number per token drawn, not one per
    // vocabulary entry, and the same tensor ops on every device). The first index whose
    // cumulative sum exceeds u * total skips zero-probability tokens; u * total rounding up to
    // the total takes the last token with probability.
    auto u = torch::empty({K}, torch::TensorOptions(torch::kDouble));
    for (std::int64_t i = 0; i < K; ++i) u[i].uniform_(0.0, 1.0, rows[static_cast<std::size_t>(i)]->gen);
    const auto cdf = probs.cumsum(-1);                      // (K, V)
    const auto total = cdf.select(1, V - 1).unsqueeze(1).contiguous();  // (K, 1): NaN when the distribution holds NaN
    const auto target = u.to(dev, lp_dtype, /*non_blocking=*/true).unsqueeze(1) * total;
    auto next = torch::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true);
    next = torch::where(next >= V, torch::searchsorted(cdf, total), next).squeeze(1).clamp_max(V - 1);
    const auto lp = filtering ? lsm.gather(1, next.unsqueeze(1)).squeeze(1)
                              : probs.gather(1, next.unsqueeze(1)).squeeze(1).log();
    const auto nan = total.isnan().any().to(torch::kDouble).reshape({1});
    const auto read = to_host(torch::cat({nan, next.to(torch::kDouble), lp.to(torch::kDouble)}));
    UNIRL_CHECK(read[0] == 0.0, "engine: a next-token distribution holds NaN (the model's logits are not finite); "
                                "expected finite logits");
    for (std::int64_t i = 0; i < K; ++i) {
      auto& s = *rows[static_cast<std::size_t>(i)];
      const auto tok = static_cast<std::int64_t>(read[static_cast<std::size_t>(1 + i)]);
      s.tokens.push_back(tok);
      s.logp.push_back(read[static_cast<std::size_t>(1 + K + i)]);
      s.versions.push_back(version_);
      auto& first = first_draw_[static_cast<std::size_t>(s.request)];
      if (first < 0) first = version_;
      if (o_.keep_logits) s.logits.push_back(raw[i].clone());
      finish_if_done(s, out);
    }
  }
  const sampling_options& spec(const sequence& s) const { return requests_[static_cast<std::size_t>(s.request)].sampling; }

  void finish_if_done(sequence& s, std::vector<result>& out) {
    const auto& req = requests_[static_cast<std::size_t>(s.request)];
    const auto tok = s.tokens.back();
    const auto generated = static_cast<std::int64_t>(s.tokens.size()) - s.turn_start;
    std::optional<finish_reason> why;
    if (std::find(req.sampling.stop_tokens.begin(), req.sampling.stop_tokens.end(), tok) != req.sampling.stop_tokens.end())
      why = finish_reason::stop_token;
    else if (!req.stop_strings.empty()) {
      const auto text = decode_(std::vector<std::int64_t>(s.tokens.begin() + s.turn_start, s.tokens.end()));
      for (const auto& st : req.stop_strings)
        if (text.find(st) != std::string::npos) {
          why = req.pause_at_stop_string ? finish_reason::paused : finish_reason::stop_string;
          break;
        }
    }
    if (!why && generated >= s.max_new) why = finish_reason::length;
    if (!why) return;
    result r;
    r.request = s.request;
    r.sample = s.sample;
    r.sequence = s.id;
    r.tokens.assign(s.tokens.begin() + s.turn_start, s.tokens.end());
    r.logp = std::move(s.logp);
    r.versions = std::move(s.versions);
    r.reason = *why;
    if (o_.keep_logits && !s.logits.empty()) r.logits = torch::stack(s.logits);
    s.logp.clear();
    s.versions.clear();
    s.logits.clear();
    out.push_back(std::move(r));
    running_.erase(std::find(running_.begin(), running_.end(), &s));
    if (*why == finish_reason::paused) {
      s.st = state::paused;
      return;
    }
    pool_.release(s.table);
    seqs_.erase(s.id);
  }

  void fill_stats() {
    stats_.running = static_cast<std::int64_t>(running_.size());
    stats_.waiting = static_cast<std::int64_t>(waiting_.size());
    stats_.paused = 0;
    stats_.live_token_blocks = 0;
    for (const auto& [id, s] : seqs_) {
      if (s->st == state::paused) ++stats_.paused;
      if (s->st != state::waiting) stats_.live_token_blocks += pool_.blocks_for(s->computed);
    }
    stats_.used_blocks = pool_.used_blocks();
    stats_.kv_bytes = stats_.used_blocks * o_.block_size * slot_bytes_;
  }

  const M& model_;
  engine_options o_;
  token_decoder decode_;
  block_pool pool_;
  paged_kv kv_;
  std::int64_t slot_bytes_ = 0;
  std::int64_t version_ = 0;
  std::int64_t next_seq_ = 0;
  std::vector<request> requests_;
  std::vector<std::int64_t> first_draw_;  // per request: the version of its first drawn token, -1 before
  std::map<std::int64_t, std::unique_ptr<sequence>> seqs_;
  std::deque<sequence*> waiting_;
  std::vector<sequence*> running_;
  engine_stats stats_;
};

}  // namespace unirl::rollout

BOOST_HANA_ADAPT_STRUCT(unirl::rollout::engine_options, block_size, kv_tokens, max_sequences, max_batch_tokens,
                        prefix_cache, keep_logits);
