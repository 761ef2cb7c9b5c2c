#pragma once
/// \file toolbox.hpp
/// `toolbox<Tools...>`: tools (the `Tool` concept) composed at compile time in a
/// `boost::hana::tuple`, as `rewards::weighted` composes scorers, with a bounded pool of worker
/// threads that runs their calls under a per-call time limit. Torch-free.
///
/// ```cpp
/// unirl::agents::toolbox<calculator, clock_tool> tools{{.timeout_seconds = 2.0, .threads = 4}};
/// auto turn = tools.begin_turn(model_text);    // parses every <tool_call>, starts the valid ones
/// while (!turn.ready()) other_work();           // the calls run on the pool meanwhile
/// for (const auto& reply : turn.replies()) append(reply);   // one text per call, errors included
/// auto stats = tools.stats();                   // {"tool/calls": 3, "tool/timed_out": 1, ...}
/// ```
///
/// Every call the model wrote gets exactly one reply: the tool's result (cut to
/// `max_result_bytes`), or `error: ...` naming the fault — malformed JSON, an unknown tool (the
/// known ones listed), arguments that do not fit the tool's schema (`check_arguments`), a call
/// too large, a tool that threw (its message), a call past its time limit. Each fault is counted
/// in `stats()`; none escapes as an exception, and no call blocks the caller past its limit.
/// A call past its limit is abandoned: its stop token is stopped (`StoppableTool`) and its result,
/// when it comes, is dropped; it keeps its worker until it returns, so a pool of `threads` workers
/// runs at most `threads` calls at once and later calls wait their turn (inside their own limit).
/// The destructor stops every call and waits for the workers.
#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>

#include <unirl/agents/tool_call.hpp>
#include <unirl/concepts/text_agent.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>

namespace unirl::agents {

/// Options of a `toolbox`.
struct toolbox_options {
  double timeout_seconds = 5.0;        // per call, from the moment it is started
  std::int64_t threads = 4;            // worker threads (calls running at once)
  std::int64_t max_result_bytes = 4096;  // a longer result is cut (and says so)
  tool_call_limits limits{};

  void validate(const std::string& p) const {
    options::require(timeout_seconds > 0.0, p + "timeout_seconds", timeout_seconds, "> 0");
    options::require(threads >= 1, p + "threads", threads, ">= 1");
    options::require(max_result_bytes >= 16, p + "max_result_bytes", max_result_bytes, ">= 16");
  }
};

}  // namespace unirl::agents

BOOST_HANA_ADAPT_STRUCT(unirl::agents::tool_call_limits, max_call_bytes, max_depth, max_calls);
BOOST_HANA_ADAPT_STRUCT(unirl::agents::toolbox_options, timeout_seconds, threads, max_result_bytes, limits);
template <>
inline constexpr std::array unirl::options::field_docs<unirl::agents::tool_call_limits>{
    unirl::options::field_doc{"max_call_bytes", "bytes between <tool_call> and </tool_call>; a longer call is a fault"},
    unirl::options::field_doc{"max_depth", "nesting of a call's JSON arrays and objects"},
    unirl::options::field_doc{"max_calls", "calls in one turn; further ones are one fault"}};
template <>
inline constexpr std::array unirl::options::field_docs<unirl::agents::toolbox_options>{
    unirl::options::field_doc{"timeout_seconds", "time limit of one tool call, from its start"},
    unirl::options::field_doc{"threads", "worker threads: tool calls running at once"},
    unirl::options::field_doc{"max_result_bytes", "a longer tool result is cut (and says so)"}};

namespace unirl::agents {

/// A fixed set of worker threads running tool calls, each with a deadline (used by `toolbox`).
class tool_pool {
 public:
  using clock = std::chrono::steady_clock;
  /// One call in flight: done, or past its deadline, or running.
  struct task {
    std::function<std::string(std::stop_token)> fn;
    std::stop_source stop;
    clock::time_point deadline;
    std::mutex m;
    bool done = false, started = false, threw = false;  // started: false when its limit passed while queued
    std::string result;  // the result, or what it threw
  };

  explicit tool_pool(std::int64_t threads) {
    for (std::int64_t i = 0; i < threads; ++i) workers_.emplace_back([this](std::stop_token st) { work(st); });
  }
  tool_pool(const tool_pool&) = delete;
  tool_pool& operator=(const tool_pool&) = delete;
  ~tool_pool() {
    {
      std::lock_guard lk(m_);
      for (auto& t : queue_) t->stop.request_stop();
      for (auto& t : running_) t->stop.request_stop();
      closing_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.request_stop();
    cv_.notify_all();
    workers_.clear();  // joins: a call that never returns is waited for here
  }

  /// Queues `fn` to run within `timeout` from now.
  std::shared_ptr<task> submit(std::function<std::string(std::stop_token)> fn, std::chrono::nanoseconds timeout) {
    auto t = std::make_shared<task>();
    t->fn = std::move(fn);
    t->deadline = clock::now() + timeout;
    {
      std::lock_guard lk(m_);
      queue_.push_back(t);
    }
    cv_.notify_all();
    return t;
  }

  /// Calls finished so far (a counter `wait_for_change` waits on).
  std::uint64_t finished() const {
    std::lock_guard lk(m_);
    return finished_;
  }
  /// Blocks until a call finishes after `seen` calls had, or until `until`.
  void wait_for_change(std::uint64_t seen, clock::time_point until) {
    std::unique_lock lk(m_);
    done_cv_.wait_until(lk, until, [&] { return finished_ != seen; });
  }

 private:
  void work(std::stop_token st) {
    for (;;) {
      std::shared_ptr<task> t;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return closing_ || st.stop_requested() || !queue_.empty(); });
        if (queue_.empty()) return;
        t = queue_.front();
        queue_.pop_front();
        running_.push_back(t);
      }
      std::string r;
      bool threw = false;
      const bool start = clock::now() < t->deadline && !t->stop.stop_requested();
      if (start) {
        try {
          r = t->fn(t->stop.get_token());
        } catch (const std::exception& e) {
          threw = true;
          r = e.what();
        } catch (...) {
          threw = true;
          r = "an exception that is not a std::exception";
        }
      }
      {
        std::lock_guard tl(t->m);
        t->done = true;
        t->started = start;
        t->threw = threw;
        t->result = std::move(r);
      }
      {
        std::lock_guard lk(m_);
        running_.erase(std::find(running_.begin(), running_.end(), t));
        ++finished_;
      }
      done_cv_.notify_all();
    }
  }

  mutable std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::shared_ptr<task>> queue_;
  std::vector<std::shared_ptr<task>> running_;
  std::uint64_t finished_ = 0;
  bool closing_ = false;
  std::vector<std::jthread> workers_;  // last: joined first when destroyed
};

/// Counts of what happened to the calls of a toolbox (statistics `tool/<kind>`).
struct tool_stats {
  std::int64_t calls = 0;  // every call found in the text, faulty ones included
  std::int64_t ok = 0;
  std::map<tool_fault, std::int64_t> faults{};

  std::int64_t count(tool_fault f) const {
    const auto it = faults.find(f);
    return it == faults.end() ? 0 : it->second;
  }
  /// `{"tool/calls": n, "tool/ok": k, "tool/malformed": ..., ...}` (every kind, zeros included).
  std::map<std::string, double> to_map() const {
    std::map<std::string, double> m{{"tool/calls", static_cast<double>(calls)}, {"tool/ok", static_cast<double>(ok)}};
    for (const auto f : {tool_fault::malformed, tool_fault::too_large, tool_fault::unknown_tool,
                         tool_fault::bad_arguments, tool_fault::threw, tool_fault::timed_out})
      m[std::string("tool/") + fault_name(f)] = static_cast<double>(count(f));
    return m;
  }
};

/// The calls of one model turn: each resolves to a reply (see the file comment).
class tool_turn {
 public:
  struct slot {
    std::string name;
    std::shared_ptr<tool_pool::task> task;  // null: resolved at parse time
    std::string reply;
    tool_fault fault = tool_fault::none;
  };

  /// How many calls the turn holds (0: the text called no tool).
  std::size_t size() const { return slots_.size(); }
  bool empty() const { return slots_.empty(); }
  /// True when every call finished or passed its time limit.
  bool ready(tool_pool::clock::time_point now = tool_pool::clock::now()) const {
    for (const auto& s : slots_)
      if (s.task && now < s.task->deadline) {
        std::lock_guard lk(s.task->m);
        if (!s.task->done) return false;
      }
    return true;
  }
  /// The earliest deadline of a call still running (now when none).
  tool_pool::clock::time_point next_deadline() const {
    auto t = tool_pool::clock::time_point::max();
    for (const auto& s : slots_)
      if (s.task) t = std::min(t, s.task->deadline);
    return t == tool_pool::clock::time_point::max() ? tool_pool::clock::now() : t;
  }
  /// One reply per call, in order (the turn must be `ready`); counts them in the toolbox's stats.
  /// A second call returns the same replies without counting again.
  std::vector<std::string> replies() {
    if (!resolved_) resolve();
    std::vector<std::string> out;
    for (const auto& s : slots_) out.push_back(s.reply);
    return out;
  }
  /// What happened to each call (after `replies`).
  std::vector<tool_fault> faults() const {
    std::vector<tool_fault> out;
    for (const auto& s : slots_) out.push_back(s.fault);
    return out;
  }

 private:
  template <class...>
  friend class toolbox;
  void resolve() {
    resolved_ = true;
    for (auto& s : slots_) {
      if (!s.task) continue;
      std::lock_guard lk(s.task->m);
      if (s.task->done && s.task->started) {
        if (s.task->threw) {
          s.fault = tool_fault::threw;
          s.reply = "error: the tool '" + s.name + "' failed: " + detail::shorten(s.task->result, 200);
        } else {
          s.reply = std::move(s.task->result);
          if (static_cast<std::int64_t>(s.reply.size()) > max_result_) {
            s.reply.resize(static_cast<std::size_t>(max_result_) - 12);
            s.reply += " [truncated]";
          }
        }
      } else {
        s.fault = tool_fault::timed_out;
        s.reply = "error: the tool '" + s.name + "' did not answer within " + timeout_text_;
        s.task->stop.request_stop();
      }
      s.task.reset();
    }
    if (stats_ != nullptr) {
      std::lock_guard lk(*stats_mutex_);
      for (const auto& s : slots_) {
        ++stats_->calls;
        if (s.fault == tool_fault::none) ++stats_->ok;
        else ++stats_->faults[s.fault];
      }
    }
  }

  std::vector<slot> slots_;
  bool resolved_ = false;
  std::int64_t max_result_ = 4096;
  std::string timeout_text_;
  tool_stats* stats_ = nullptr;
  std::mutex* stats_mutex_ = nullptr;
};

/// Tools held in a compile-time list, called by name from the text a model wrote.
///
/// Minimal requirement on each of `Tools`: `unirl::Tool` (concepts/text_agent.hpp); a type that
/// is not one fails to compile with a message naming the concept. Tool names must differ.
template <class... Tools>
class toolbox {
  static_assert(sizeof...(Tools) > 0, "unirl::agents::toolbox needs at least one tool");
  static_assert((Tool<Tools> && ...),
                "unirl::agents::toolbox: a tool does not model unirl::Tool (concepts/text_agent.hpp): it needs "
                "`std::string name() const`, `std::string description() const`, `nlohmann::json parameters() const` "
                "(a JSON schema) and `std::string call(const nlohmann::json&) const`");

 public:
  using options = toolbox_options;
  static constexpr std::size_t size = sizeof...(Tools);

  explicit toolbox(options o, Tools... tools)
      : tools_(std::move(tools)...), o_((unirl::options::validate(o), o)),
        pool_(std::make_unique<tool_pool>(o_.threads)) {
    boost::hana::for_each(tools_, [&](const auto& t) {
      const std::string n = t.name();
      UNIRL_CHECK(!n.empty(), "toolbox: a tool's name() is empty; expected the name the model writes");
      UNIRL_CHECK(std::find(names_.begin(), names_.end(), n) == names_.end(), "toolbox: two tools are named '", n,
                  "'; expected distinct names");
      names_.push_back(n);
      enabled_.push_back(true);
      schemas_.push_back(t.parameters());
      UNIRL_CHECK(schemas_.back().is_object(), "toolbox: tool '", n, "' has parameters() = ",
                  schemas_.back().dump(), "; expected a JSON schema object");
    });
    active_names_ = names_;
  }
  explicit toolbox(Tools... tools) : toolbox(options{}, std::move(tools)...) {}

  const options& opts() const { return o_; }
  /// The names of the selected tools (all, unless `select` chose some).
  const std::vector<std::string>& names() const { return active_names_; }

  /// Keeps only the tools named in `names` (empty: none): the others are not listed to the
  /// model, and a call of one is answered as a call of an unknown tool. A name that is no tool of
  /// this toolbox is a `config_error` on `key` naming it and the tools there are.
  /// ```cpp
  /// tools.select({"calculator"});
  /// ```
  void select(const std::vector<std::string>& names, const std::string& key = "tools") {
    std::vector<bool> on(names_.size(), false);
    for (const auto& n : names) {
      const auto it = std::find(names_.begin(), names_.end(), n);
      if (it == names_.end()) {
        std::string known;
        for (const auto& k : names_) known += (known.empty() ? "" : ", ") + k;
        throw config_error(key, "unknown tool '" + n + "'; the tools are " + known);
      }
      on[static_cast<std::size_t>(it - names_.begin())] = true;
    }
    enabled_ = std::move(on);
    active_names_.clear();
    for (std::size_t i = 0; i < names_.size(); ++i)
      if (enabled_[i]) active_names_.push_back(names_[i]);
  }

  /// The tool definitions a chat template lists (`apply_chat_template(..., tools)`):
  /// `{"type": "function", "function": {"name", "description", "parameters"}}` per tool.
  std::vector<nlohmann::json> definitions() const {
    std::vector<nlohmann::json> out;
    std::size_t i = 0;
    boost::hana::for_each(tools_, [&](const auto& t) {
      if (enabled_[i])
        out.push_back({{"type", "function"},
                       {"function", {{"name", names_[i]}, {"description", t.description()}, {"parameters", schemas_[i]}}}});
      ++i;
    });
    return out;
  }

  /// Parses every tool call in `text` and starts the valid ones on the pool.
  tool_turn begin_turn(std::string_view text) {
    tool_turn turn;
    turn.max_result_ = o_.max_result_bytes;
    turn.timeout_text_ = std::to_string(o_.timeout_seconds) + " s";
    turn.stats_ = &stats_;
    turn.stats_mutex_ = &stats_mutex_;
    for (auto& p : find_tool_calls(text, o_.limits)) {
      tool_turn::slot s;
      if (!p.ok()) {
        s.fault = p.fault;
        s.reply = "error: " + p.error;
        turn.slots_.push_back(std::move(s));
        continue;
      }
      s.name = detail::shorten(p.call->name);
      const auto it = std::find(names_.begin(), names_.end(), p.call->name);
      if (it == names_.end() || !enabled_[static_cast<std::size_t>(it - names_.begin())]) {
        s.fault = tool_fault::unknown_tool;
        std::string known;
        for (const auto& n : active_names_) known += (known.empty() ? "" : ", ") + n;
        s.reply = "error: there is no tool named '" + s.name + "'; the tools are " + known;
        turn.slots_.push_back(std::move(s));
        continue;
      }
      const auto index = static_cast<std::size_t>(it - names_.begin());
      if (auto why = check_arguments(schemas_[index], p.call->arguments); !why.empty()) {
        s.fault = tool_fault::bad_arguments;
        s.reply = "error: bad arguments for '" + s.name + "': " + why;
        turn.slots_.push_back(std::move(s));
        continue;
      }
      s.task = pool_->submit(invoker(index, std::move(p.call->arguments)),
                             std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::duration<double>(o_.timeout_seconds)));
      turn.slots_.push_back(std::move(s));
    }
    return turn;
  }

  /// `begin_turn(text)`, waited for: the replies of every call in `text` (empty: none).
  std::vector<std::string> call(std::string_view text) {
    auto turn = begin_turn(text);
    wait(turn);
    return turn.replies();
  }
  /// Blocks until `turn` is ready (each call finished or past its limit).
  void wait(const tool_turn& turn) {
    for (;;) {
      const auto seen = pool_->finished();
      if (turn.ready()) return;
      pool_->wait_for_change(seen, turn.next_deadline());
    }
  }
  /// Blocks until a call finishes or `until` passes (the rollout's idle wait).
  void wait_for_any(tool_pool::clock::time_point until) { pool_->wait_for_change(pool_->finished(), until); }
  /// Calls finished so far (pair with `wait_for_change` to wait without missing one).
  std::uint64_t finished() const { return pool_->finished(); }
  void wait_for_change(std::uint64_t seen, tool_pool::clock::time_point until) { pool_->wait_for_change(seen, until); }

  /// What happened to the calls so far.
  tool_stats stats() const {
    std::lock_guard lk(stats_mutex_);
    return stats_;
  }
  void reset_stats() {
    std::lock_guard lk(stats_mutex_);
    stats_ = {};
  }

  /// The `I`-th tool.
  template <std::size_t I>
  auto& get() { return tools_[boost::hana::size_c<I>]; }

 private:
  std::function<std::string(std::stop_token)> invoker(std::size_t index, nlohmann::json args) {
    std::function<std::string(std::stop_token)> f;
    std::size_t i = 0;
    boost::hana::for_each(tools_, [&](const auto& t) {
      if (i++ != index) return;
      const auto* tool = &t;
      using T = std::remove_cvref_t<decltype(t)>;
      // One lambda per kind of tool: GCC 12 warns of a missing return on an `if constexpr` inside one.
      if constexpr (StoppableTool<T>)
        f = [tool, args = std::move(args)](std::stop_token st) { return std::string(tool->call(args, st)); };
      else
        f = [tool, args = std::move(args)](std::stop_token) { return std::string(tool->call(args)); };
    });
    return f;
  }

  boost::hana::tuple<Tools...> tools_;
  options o_;
  std::vector<std::string> names_;         // every tool's, in the tuple's order
  std::vector<bool> enabled_;              // per tool: selected (`select`)
  std::vector<std::string> active_names_;  // the selected tools' names
  std::vector<nlohmann::json> schemas_;
  mutable std::mutex stats_mutex_;
  tool_stats stats_;
  std::unique_ptr<tool_pool> pool_;  // last: its workers stop before the tools they call go
};

}  // namespace unirl::agents


