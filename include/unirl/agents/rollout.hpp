#pragma once
/// \file rollout.hpp
/// Multi-turn episodes on the rollout engine (rollout/engine.hpp): many episodes in flight; a
/// sequence whose turn ends (the chat format's end-of-turn marker; with `stop_at_tool_call` also
/// `</tool_call>`) pauses and
/// keeps its KV blocks; its tool calls run on the toolbox's pool (a per-call time limit) or its
/// text goes to the environment, while the other sequences keep decoding; then it resumes with
/// the reply appended, without prefilling its past again. Each episode is one `trajectory`.
///
/// ```cpp
/// unirl::agents::toolbox<calculator> tools{{.timeout_seconds = 1.0}};
/// auto out = unirl::agents::run_episodes(model, arithmetic_env{}, /*seeds=*/{1, 2, 3}, /*group=*/8, tools,
///                                        {.encode = enc, .decode = dec},
///                                        {.format = unirl::tokenizers::chat_format::chatml, .max_turns = 3});
/// for (const auto& t : out.episodes) use(t.tokens, t.policy, t.reward);   // 3 tasks x 8 episodes
/// ```
///
/// An episode: the environment's first observation is the user's message (rendered by the chat
/// template with the tools listed, tokenized once per task: the G episodes of a task share the
/// prompt's blocks). Each policy turn ends at the end-of-turn marker (or `</tool_call>`), at a
/// stop token or at `max_turn_tokens` (these two end the episode, after `env.step` scores the
/// turn). A turn that calls tools (several calls run at once) gets their replies
/// (`render_continuation` with `tool` messages); any other turn goes to `env.step(text)`, whose
/// reward is the turn's and whose observation, unless done, is the next user message. Limits:
/// `max_turns` policy turns and `max_episode_tokens` tokens per episode. The tokens of the
/// template's markers around a reply are context (not trained), except those the policy sampled.
/// `lockstep` is the baseline without overlap: no sequence decodes while any tool call runs.
/// An environment that shows images (`image_observation`, `image_step`) needs a vision-language
/// policy (one with an image table, `images()`): each image is registered once and its
/// image-slot ids take its marker's place; `stats["images"]` counts them.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/agents/image_observation.hpp>
#include <unirl/agents/toolbox.hpp>
#include <unirl/agents/trajectory.hpp>
#include <unirl/concepts/causal_lm.hpp>
#include <unirl/concepts/text_agent.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rollout/engine.hpp>
#include <unirl/rollout/sampling.hpp>
#include <unirl/rollout/token.hpp>
#include <unirl/tokenizers/chat.hpp>

template <>
inline constexpr std::array unirl::enum_names<unirl::tokenizers::chat_format>{
    std::string_view{"chatml"}, std::string_view{"qwen2_5"}, std::string_view{"llama3"}, std::string_view{"plain"}};

namespace unirl::agents {

/// How a multi-turn rollout runs.
struct agent_options {
  tokenizers::chat_format format = tokenizers::chat_format::chatml;
  std::string system{};                  // the system message; empty = the format's default (none for chatml)
  std::int64_t max_turns = 4;            // policy turns per episode
  std::int64_t max_turn_tokens = 64;     // tokens per policy turn
  std::int64_t max_episode_tokens = 512; // tokens per episode (prompt, turns and replies)
  sampling_options sampling{};           // temperature, top-k / top-p, stop tokens (they end the episode)
  bool stop_at_tool_call = false;        // a turn also ends at `</tool_call>` (one call per turn)
  bool lockstep = false;                 // baseline: nothing decodes while a tool call runs
  rollout::engine_options engine{};      // kv_tokens is raised to hold every episode at once (paused ones keep blocks)

  void validate(const std::string& p) const {
    options::require(max_turns >= 1, p + "max_turns", max_turns, ">= 1");
    options::require(max_turn_tokens >= 1, p + "max_turn_tokens", max_turn_tokens, ">= 1");
    options::require(max_episode_tokens >= 2, p + "max_episode_tokens", max_episode_tokens, ">= 2");
  }
};

}  // namespace unirl::agents

BOOST_HANA_ADAPT_STRUCT(unirl::agents::agent_options, format, system, max_turns, max_turn_tokens, max_episode_tokens,
                        sampling, stop_at_tool_call, lockstep, engine);

namespace unirl::agents {

/// The tokenizer a rollout uses: `encode` for context text (called once per segment), `decode`
/// to read a turn (stop strings, tool calls, the environment) — its output is never re-encoded.
struct agent_text {
  token_encoder encode;
  token_decoder decode;
};

/// No tools: `run_episodes` without a toolbox (turns go to the environment).
struct no_tools {};

/// What `run_episodes` returns: the episodes (task-major: task i's G episodes at [i*G, (i+1)*G))
/// and the rollout's statistics.
struct episodes_result {
  std::vector<trajectory> episodes;
  std::map<std::string, double> stats;  // episodes, turns_mean, reward_mean, tool_call_rate, tool/... (this rollout's), seconds, ...
};

namespace detail {
inline bool ends_with(const std::string& text, const std::string& tail) {
  return text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}
// The turn's end-of-turn marker without a trailing newline (`<|im_end|>`): what the model writes.
// The images an observation shows (none for a `text_observation`).
template <class O>
const std::vector<torch::Tensor>& images_of(const O& o) {
  static const std::vector<torch::Tensor> none;
  if constexpr (requires { o.images; }) return o.images;
  else return none;
}
inline std::string turn_stop(tokenizers::chat_format f) {
  auto s = tokenizers::assistant_turn_end(f);
  if (f != tokenizers::chat_format::plain)
    while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}
}  // namespace detail

/// Runs `group` episodes of each task `seeds[i]` (a copy of `env` reset with that seed for each)
/// with the policy `model` on the rollout engine; `tools` (a `toolbox`, or `no_tools{}`) answers
/// the tool calls (a toolbox with no tool selected acts as `no_tools`). See the file comment. Call under `torch::NoGradGuard`.
template <PagedCausalLM M, TextEnvironment E, class Tools = no_tools>
episodes_result run_episodes(const M& model, const E& env, const std::vector<std::uint64_t>& seeds,
                             std::int64_t group, Tools& tools, const agent_text& text, const agent_options& o) {
  constexpr bool has_tools = !std::is_same_v<std::remove_cvref_t<Tools>, no_tools>;
  unirl::options::validate(o);
  UNIRL_CHECK(group >= 1, "run_episodes: group = ", group, ": expected >= 1");
  UNIRL_CHECK(!seeds.empty(), "run_episodes: no seeds; expected one per task");
  UNIRL_CHECK(static_cast<bool>(text.encode) && static_cast<bool>(text.decode),
              "run_episodes: agent_text needs encode and decode");
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  tool_stats tools_before{};
  if constexpr (has_tools) tools_before = tools.stats();
  const auto n_tasks = static_cast<std::int64_t>(seeds.size());
  const auto B = n_tasks * group;
  const auto f = o.format;
  const auto stop_text = detail::turn_stop(f);

  auto eo = o.engine;
  eo.max_sequences = std::max(eo.max_sequences, group);
  const auto per = (o.max_episode_tokens + eo.block_size - 1) / eo.block_size * eo.block_size;
  eo.kv_tokens = std::max(eo.kv_tokens, B * per);
  rollout::engine<M> eng{model, eo, text.decode};

  std::vector<trajectory> eps(static_cast<std::size_t>(B));
  std::vector<E> envs;
  envs.reserve(static_cast<std::size_t>(B));
  std::vector<std::int64_t> seq_of(static_cast<std::size_t>(B), -1);
  std::vector<nlohmann::json> defs;
  if constexpr (has_tools) {
    if (f == tokenizers::chat_format::chatml || f == tokenizers::chat_format::qwen2_5) defs = tools.definitions();
  }
  std::vector<std::string> stops{stop_text};
  if constexpr (has_tools)
    if (o.stop_at_tool_call) stops.push_back(std::string(tool_call_close));
  std::int64_t encode_calls = 0, images_shown = 0;
  auto encode_text = [&](const std::string& s) {
    ++encode_calls;
    return text.encode(s);
  };
  // Context text with its images (`encode_with_images`): the text between markers tokenized once
  // each, every image registered in the policy's table once, its image-slot ids in its marker's place.
  auto encode = [&](const std::string& s, const std::vector<torch::Tensor>& images) -> std::vector<std::int64_t> {
    if (images.empty()) return encode_text(s);
    if constexpr (requires { model.images().add(images.front()); }) {
      auto ids = encode_with_images(model, encode_text, s, images);
      images_shown += static_cast<std::int64_t>(images.size());
      return ids;
    } else {
      throw ::unirl::error("unirl: run_episodes: the environment shows " + std::to_string(images.size()) +
                           " image(s), but the policy has no image table (images()): expected a vision-language "
                           "model (models::vlm::vlm)");
    }
  };
  const auto ctx = static_cast<std::int64_t>(model.max_length());
  auto turn_limit = [&](std::int64_t len) {
    return std::min({o.max_turn_tokens, o.max_episode_tokens - len, ctx - len});
  };

  for (std::int64_t i = 0; i < n_tasks; ++i) {
    std::vector<std::int64_t> prompt;
    for (std::int64_t g = 0; g < group; ++g) {
      envs.push_back(env);
      const auto first = envs.back().reset(seeds[static_cast<std::size_t>(i)]);
      if (g > 0) continue;
      const auto& images = detail::images_of(first);
      if (!first.tokens.empty()) {
        UNIRL_CHECK(images.empty(), "run_episodes: task ", i, "'s first observation has token ids and ", images.size(),
                    " image(s); images go with text (their markers say where)");
        prompt = first.tokens;
      } else {
        std::vector<tokenizers::chat_message> msgs;
        if (!o.system.empty()) msgs.push_back({"system", o.system});
        msgs.push_back({"user", first.text});
        prompt = encode(tokenizers::apply_chat_template(f, msgs, true, defs), images);
      }
    }
    const auto limit = turn_limit(static_cast<std::int64_t>(prompt.size()));
    UNIRL_CHECK(limit >= 1, "run_episodes: task ", i, "'s prompt has ", prompt.size(),
                " tokens, which leaves no room for a turn (max_episode_tokens = ", o.max_episode_tokens,
                ", the model's context = ", ctx, ")");
    for (std::int64_t g = 0; g < group; ++g) {
      auto& t = eps[static_cast<std::size_t>(i * group + g)];
      t.task = i;
      t.append_context(prompt);
    }
    auto s = o.sampling;
    s.max_new_tokens = limit;
    eng.submit({.prompt = prompt, .sampling = s, .seed = seeds[static_cast<std::size_t>(i)] * 0x9E3779B97F4A7C15ull + 1,
                .n = group, .stop_strings = stops, .pause_at_stop_string = true});
  }

  struct pending_turn {
    std::int64_t episode;
    tool_turn turn;
  };
  std::vector<pending_turn> pending;
  std::int64_t finished = 0, tool_turns = 0;
  auto finish = [&](std::int64_t e, episode_end why, bool release) {
    auto& t = eps[static_cast<std::size_t>(e)];
    t.end = why;
    if (release) eng.release(seq_of[static_cast<std::size_t>(e)]);
    ++finished;
  };
  // Appends `cont` (context text) and resumes episode e, or ends it at a limit.
  auto continue_with = [&](std::int64_t e, const std::string& cont, const std::vector<torch::Tensor>& images) {
    auto& t = eps[static_cast<std::size_t>(e)];
    if (t.turns() >= o.max_turns) return finish(e, episode_end::max_turns, true);
    const auto ids = encode(cont, images);
    const auto limit = turn_limit(t.size() + static_cast<std::int64_t>(ids.size()));
    if (limit < 1) return finish(e, episode_end::max_tokens, true);
    t.append_context(ids);
    eng.resume(seq_of[static_cast<std::size_t>(e)], ids, limit);
  };
  // The continuation after a turn whose text is `turn`: what the template renders between the
  // policy's content and the next generation prompt, less the end marker when the policy wrote it.
  auto continuation = [&](const std::string& turn, const std::vector<tokenizers::chat_message>& next) {
    const auto cont = tokenizers::render_continuation(f, next);
    return detail::ends_with(turn, stop_text) ? cont.substr(stop_text.size()) : cont;
  };

  auto handle = [&](rollout::result& r) {
    const auto e = r.request * group + r.sample;
    auto& t = eps[static_cast<std::size_t>(e)];
    seq_of[static_cast<std::size_t>(e)] = r.sequence;
    t.append_policy(r.tokens, r.logp);
    if (r.logits.defined()) t.logits.push_back(r.logits);
    std::string said = text.decode(r.tokens);
    const bool open = r.reason == rollout::finish_reason::paused;
    // The text the environment and the parser read: the turn up to its end marker.
    std::string content = said;
    if (const auto at = content.find(stop_text); open && at != std::string::npos) content.resize(at);
    bool calls = false;
    if constexpr (has_tools) calls = !tools.names().empty() && content.find(tool_call_open) != std::string::npos;
    if (calls && open) {
      if constexpr (has_tools) {
        auto turn = tools.begin_turn(content);
        t.tool_calls += static_cast<std::int64_t>(turn.size());
        t.end_turn(0.0, said);
        ++tool_turns;
        pending.push_back({e, std::move(turn)});
      }
      return;
    }
    const auto st = envs[static_cast<std::size_t>(e)].step(content);
    const auto& images = detail::images_of(st.observation);
    t.end_turn(st.reward, said);
    if (!open) return finish(e, r.reason == rollout::finish_reason::length ? episode_end::max_tokens
                                                                           : episode_end::stop_token,
                             false);
    if (st.done) return finish(e, episode_end::done, true);
    if (!st.observation.tokens.empty()) {
      UNIRL_CHECK(images.empty(), "run_episodes: an observation has token ids and ", images.size(),
                  " image(s); images go with text (their markers say where)");
      if (t.turns() >= o.max_turns) return finish(e, episode_end::max_turns, true);
      const auto limit = turn_limit(t.size() + static_cast<std::int64_t>(st.observation.tokens.size()));
      if (limit < 1) return finish(e, episode_end::max_tokens, true);
      t.append_context(st.observation.tokens);
      eng.resume(seq_of[static_cast<std::size_t>(e)], st.observation.tokens, limit);
      return;
    }
    continue_with(e, continuation(said, {{"user", st.observation.text}}), images);
  };

  auto poll = [&] {
    const auto now = clock::now();
    if (o.lockstep) {  // every call of the round first
      for (const auto& p : pending)
        if (!p.turn.ready(now)) return;
    }
    for (std::size_t i = 0; i < pending.size();) {
      if (!pending[i].turn.ready(now)) {
        ++i;
        continue;
      }
      auto p = std::move(pending[i]);
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
      std::vector<tokenizers::chat_message> replies;
      for (auto& x : p.turn.replies()) replies.push_back({"tool", std::move(x)});
      const auto& said = eps[static_cast<std::size_t>(p.episode)].turn_texts.back();
      continue_with(p.episode, continuation(said, replies), {});
    }
  };

  while (finished < B) {
    if constexpr (has_tools) {
      const auto seen = tools.finished();
      poll();
      const bool blocked = o.lockstep && !pending.empty();
      if (!eng.has_work() || blocked) {
        if (pending.empty()) {
          UNIRL_CHECK(finished == B, "run_episodes: ", B - finished, " episodes neither run nor wait (an engine or "
                                     "loop fault)");
          break;
        }
        auto until = clock::time_point::max();
        for (const auto& p : pending) until = std::min(until, p.turn.next_deadline());
        tools.wait_for_change(seen, until);
        continue;
      }
    }
    if (!eng.has_work()) break;
    for (auto& r : eng.step()) handle(r);
  }

  episodes_result out;
  double turns = 0, reward = 0, with_calls = 0, policy_tokens = 0, tokens = 0;
  for (const auto& t : eps) {
    turns += static_cast<double>(t.turns());
    reward += t.reward;
    with_calls += t.tool_calls > 0 ? 1.0 : 0.0;
    policy_tokens += static_cast<double>(t.policy_tokens());
    tokens += static_cast<double>(t.size());
    ++out.stats[std::string("end/") + end_name(t.end)];
  }
  const double n = static_cast<double>(B);
  const double secs = std::chrono::duration<double>(clock::now() - t0).count();
  out.stats["episodes"] = n;
  out.stats["turns_mean"] = turns / n;
  out.stats["reward_mean"] = reward / n;
  out.stats["tool_call_rate"] = with_calls / n;  // share of episodes that called a tool
  out.stats["tool_turns"] = static_cast<double>(tool_turns);
  out.stats["policy_tokens"] = policy_tokens;
  out.stats["tokens"] = tokens;
  out.stats["encode_calls"] = static_cast<double>(encode_calls);
  out.stats["images"] = static_cast<double>(images_shown);
  out.stats["engine_steps"] = static_cast<double>(eng.stats().steps);
  out.stats["seconds"] = secs;
  out.stats["episodes_per_second"] = secs > 0 ? n / secs : 0.0;
  if constexpr (has_tools) {  // this rollout's calls (the toolbox counts over its lifetime)
    const auto before = tools_before.to_map();
    for (const auto& [k, v] : tools.stats().to_map()) out.stats[k] = v - before.at(k);
  }
  out.episodes = std::move(eps);
  return out;
}

/// `run_episodes` without tools: every turn goes to the environment.
template <PagedCausalLM M, TextEnvironment E>
episodes_result run_episodes(const M& model, const E& env, const std::vector<std::uint64_t>& seeds,
                             std::int64_t group, const agent_text& text, const agent_options& o) {
  no_tools none;
  return run_episodes(model, env, seeds, group, none, text, o);
}

}  // namespace unirl::agents


