#pragma once
/// \file c10d_transport.hpp
/// The rollout transport over one PyTorch c10d world: rank 0 is the learner, ranks 1..N are
/// samplers. Weights go learner → samplers as bucketed, versioned point-to-point sends on the
/// world's process group, one per sampler (host buffers: a Gloo group; models on CUDA are copied
/// to and from them); scored batches go sampler → learner by point-to-point send / receive of
/// their encoded bytes (parallel/wire.hpp); the version counter, the stop flag and the
/// heartbeats live in the world's store (a TCPStore served by rank 0 from torchrun-style
/// variables — or torchrun's agent's, see `open_world_store` — or a FileStore). Nothing travels outside c10d.
/// A `deployment` with several learner ranks (parallel/reward_ranks.hpp) makes one such world per
/// learner, each on the deployment's store under a prefix of its own (the constructor taking a store).
///
/// ```cpp
/// // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun (or unirl-launch) sets them
/// auto tr = unirl::parallel::c10d_transport<unirl::token_rollout>::from_environment(
///     {.max_staleness = 2, .on_sampler_loss = unirl::parallel::sampler_loss::carry_on,
///      .fault_timeout = std::chrono::seconds(30)});
/// if (tr.is_learner()) { unirl::parallel::learner l{trainer, tr}; while (...) l.step(tr.samplers()); l.finish(); }
/// else { unirl::parallel::rollout_worker<...> w{model, reward, opts, tr, tr.rank() - 1}; while (w.run_once(in)) {} }
/// ```
/// Protocol. `publish(w, v)` (learner) writes `v` to the store key `unirl/rt/version`, then
/// starts one send per bucket (consecutive tensors of one dtype, at most `bucket_bytes` each —
/// a larger tensor is a bucket of its own) to every live sampler, and keeps at most
/// `max_staleness` versions in flight (0: it waits until every live sampler received them). The
/// first version need not be 0 (a learner resumed from its checkpoint starts at its step; it is
/// kept under `unirl/rt/first`, and samplers receive from it on). A
/// sampler's `fetch` receives every published version it has not received, in order, and copies
/// the newest into its model. `push` announces the message in the store (`unirl/rt/sending/<r>`),
/// sends a 3-int64 header (kind, bytes, version) then the bytes; `pop` receives the announced
/// messages (the learner never posts a receive that no sampler announced), drops batches older
/// than `max_staleness` versions, and returns the next one. `finish` (learner) sets
/// `unirl/rt/stop`, receives and discards until every live sampler said goodbye (each receives
/// the remaining versions first), waits for the sends in flight, then sets `unirl/rt/finished`
/// (what a deployment's reward ranks wait for). Every wait is bounded by `rendezvous::timeout`.
///
/// Faults (docs/parallel.md, "Faults"). Every rank bumps its heartbeat counter
/// `unirl/rt/beat/<rank>` in the store every `heartbeat` from a thread of its own (so a long
/// sampling or training step does not look like a death); whoever waits watches the others'
/// counters. A sampler whose counter has not moved for `fault_timeout`, or whose point-to-point
/// traffic failed (Gloo reports a closed connection at once), is lost: with
/// `sampler_loss::stop` the learner throws a `unirl::error` naming the rank and the cause (and
/// sets `unirl/rt/abort` so the samplers stop too); with `sampler_loss::carry_on` it sends to and
/// waits for the live samplers only (`samplers_lost()`, `lost_ranks()`; a synchronous step
/// gathers the batches of the live ones). A sampler whose learner is gone — the store does not
/// answer, the learner's counter stood still for `fault_timeout`, a send or receive failed, or
/// the learner aborted — throws a `unirl::error` naming the learner and the timeout from its next
/// `fetch` / `push`. No collective joins the samplers, so a dead rank blocks nobody.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <unirl/concepts/transport.hpp>
#include <unirl/core/error.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/wire.hpp>

namespace unirl::parallel {

/// What the learner does when a sampler is lost (killed, crashed, unreachable).
enum class sampler_loss {
  stop,      // throw a unirl::error naming the rank and the cause (the samplers stop too)
  carry_on,  // go on with the live samplers; the loss is counted (`samplers_lost()`)
};

/// Settings of `c10d_transport`.
struct transport_options {
  rendezvous rdzv{};                            // store (TCP or file), Gloo interface, timeout
  std::int64_t max_staleness = 0;               // versions a popped batch may be behind; 0: synchronous
  std::int64_t bucket_bytes = 256LL << 20;      // weight-send bucket size (seed 000: 256 MB)
  std::int64_t max_batch_bytes = 1LL << 32;     // larger batch headers are rejected (untrusted)
  sampler_loss on_sampler_loss = sampler_loss::stop;
  std::chrono::milliseconds fault_timeout{std::chrono::seconds(60)};  // a heartbeat older than this: lost
  std::chrono::milliseconds heartbeat{0};       // heartbeat period; 0: fault_timeout / 10
};

/// The store of a learner / sampler world (or of a whole `deployment`): `make_store` (a FileStore
/// at `r.file_path`, or a TCPStore at `r.host`:`r.port` served by rank 0 and awaited by
/// `world_size` ranks). Under torchrun, whose agent already serves the TCPStore at MASTER_ADDR:
/// MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), every rank joins it as a client, under
/// /worker/attempt_<TORCHELASTIC_RESTART_COUNT> — what torch.distributed's env:// does.
inline c10::intrusive_ptr<c10d::Store> open_world_store(const rendezvous& r, int rank, int world_size) {
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  if (!r.file_path.empty() || !agent || std::string(agent) != "True") return make_store(r, rank, world_size);
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(r.port);
  o.isServer = false;
  o.numWorkers = world_size;
  o.timeout = r.timeout;
  use_classic_tcpstore(o);
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::string(attempt ? attempt : "0"),
                                                c10::make_intrusive<c10d::TCPStore>(r.host, o));
}

/// `RolloutTransport` over one c10d world (see the file comment).
template <class Batch, class Backend = gloo>
class c10d_transport {
 public:
  c10d_transport(int rank, int world_size, transport_options o = {}) : rank_(rank), world_(world_size), o_(std::move(o)) {
    check_settings();
    join(open_world_store(o_.rdzv, rank, world_size));
  }

  /// A world on a store opened elsewhere — e.g. one learner group of a `deployment` with several
  /// learners, on the deployment's store under a `c10d::PrefixStore` of its own. `rank` and
  /// `world_size` are this world's (0: its learner); `o.rdzv`'s host and port are not used, its
  /// `file_path` tells whether `store` is (under any prefix) a FileStore, its timeout and Gloo
  /// interface apply.
  c10d_transport(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, transport_options o = {})
      : rank_(rank), world_(world_size), o_(std::move(o)) {
    UNIRL_CHECK(store, "c10d_transport: store is null: expected an open c10d store");
    check_settings();
    join(std::move(store));
  }

  /// Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the variables torchrun sets).
  static c10d_transport from_environment(transport_options o = {}) {
    const auto [rank, world] = read_launch_environment("c10d_transport", o.rdzv);
    return c10d_transport(rank, world, std::move(o));
  }

  c10d_transport(c10d_transport&&) = default;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  bool is_learner() const { return rank_ == 0; }
  /// Sampler ranks (1..world_size-1): the batches a synchronous learner step gathers. After a
  /// loss (`sampler_loss::carry_on`) the step gathers the live samplers' batches only.
  int samplers() const { return world_ - 1; }
  /// Samplers that neither said goodbye nor were lost.
  int live_samplers() const { return live_; }
  /// Samplers the learner lost (`sampler_loss::carry_on`), and their ranks in order of loss.
  std::int64_t samplers_lost() const { return static_cast<std::int64_t>(lost_.size()); }
  const std::vector<int>& lost_ranks() const { return lost_; }
  std::int64_t max_staleness() const { return o_.max_staleness; }
  /// Batches `pop` dropped as older than `max_staleness` versions.
  std::int64_t dropped() const { return dropped_; }
  /// The bucket size in MB (`transport_options::bucket_bytes`).
  double bucket_mb() const { return static_cast<double>(o_.bucket_bytes) / (1 << 20); }
  const transport_options& options() const { return o_; }
  /// Bytes of weights one `publish` sends to each sampler (after the first publish or fetch).
  std::int64_t weight_bytes() const {
    std::int64_t b = 0;
    for (const auto& k : plan_) b += k.bytes;
    return b;
  }

  // ---- learner (rank 0) ----

  void publish(const std::vector<torch::Tensor>& weights, std::int64_t version) {
    UNIRL_CHECK(is_learner(), "c10d_transport::publish: rank ", rank_, " is a sampler: only rank 0 publishes weights");
    UNIRL_CHECK(version > published_, "c10d_transport::publish: version ", version, " after ", published_,
                ": expected increasing versions");
    if (plan_.empty()) {
      plan_ = plan(weights);
      store_->set(key("layout"), bytes_of(layout_text(weights)));
      // A learner resumed from a checkpoint starts at its step, not at 0: the samplers receive
      // from this version on.
      store_->set(key("first"), bytes_of(std::to_string(version)));
    }
    check_layout(weights, "publish");
    flight f{version, {}, std::vector<std::vector<work_ptr>>(static_cast<std::size_t>(world_))};
    {
      torch::NoGradGuard no_grad;
      for (const auto& b : plan_) f.buffers.push_back(flatten(weights, b));  // a snapshot: training goes on
    }
    store_->set(key("version"), bytes_of(std::to_string(version)));
    for (int r = 1; r < world_; ++r) {
      if (gone_[static_cast<std::size_t>(r)]) continue;
      try {
        for (auto& buf : f.buffers) {
          std::vector<torch::Tensor> one{buf};
          f.works[static_cast<std::size_t>(r)].push_back(group_->send(one, r, tag_weights));
        }
      } catch (const std::exception& e) {
        lose(r, "sending weights failed: " + message_of(e));
      }
    }
    published_ = version;
    flights_.push_back(std::move(f));
    while (static_cast<std::int64_t>(flights_.size()) > o_.max_staleness) complete_oldest();
  }

  std::optional<versioned_batch<Batch>> pop(std::int64_t current) {
    UNIRL_CHECK(is_learner(), "c10d_transport::pop: rank ", rank_, " is a sampler: only rank 0 receives batches");
    for (;;) {
      std::optional<versioned_batch<Batch>> got;
      if (!inbox_.empty()) {
        got = std::move(inbox_.front());
        inbox_.pop_front();
      } else if (live_ > 0 && !(o_.max_staleness == 0 && !lost_.empty() && all_delivered(current))) {
        got = receive_next();
        if (!got) continue;  // a goodbye or a loss
      } else {
        // nobody left, or (synchronous, after a loss) every live sampler delivered this version
        return std::nullopt;
      }
      if (got->policy_version < current - o_.max_staleness) {
        ++dropped_;
        continue;
      }
      UNIRL_CHECK(got->policy_version <= current, "c10d_transport: batch from rank ", got->source, " drawn with version ",
                  got->policy_version, ": expected <= ", current, ", the newest published");
      return got;
    }
  }

  /// Stops the samplers: they receive the versions in flight, say goodbye and return -1 / false.
  /// Batches still arriving are discarded. Then sets the store key `unirl/rt/finished`. Idempotent.
  void finish() {
    if (!is_learner() || finished_) return;
    finished_ = true;
    store_->set(key("stop"), bytes_of("1"));
    inbox_.clear();
    while (live_ > 0) (void)receive_next();
    while (!flights_.empty()) complete_oldest();
    store_->set(key("finished"), bytes_of("1"));  // no sampler uses anything any more (reward ranks stop)
  }

  // ---- samplers (ranks 1..) ----

  std::int64_t fetch(const std::vector<torch::Tensor>& weights, std::int64_t have, std::int64_t wait_for) {
    UNIRL_CHECK(!is_learner(), "c10d_transport::fetch: rank 0 is the learner: samplers fetch weights");
    if (left_) return -1;
    const auto deadline = std::chrono::steady_clock::now() + o_.rdzv.timeout;
    std::int64_t newest = -1;
    for (;;) {
      newest = toward_learner("waiting for weights", [&] { return published(); });
      if (newest >= wait_for && newest >= 0) break;
      if (toward_learner("waiting for weights", [&] { return store_->check({key("stop")}); })) {
        leave();
        return -1;
      }
      watch_learner("waiting for weights");
      UNIRL_CHECK(std::chrono::steady_clock::now() < deadline, "c10d_transport::fetch: rank ", rank_,
                  " waited for weight version ", wait_for, " longer than the timeout (",
                  o_.rdzv.timeout.count(), " ms); the newest published is ", newest);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (plan_.empty()) {
      const std::string theirs = toward_learner("reading the weight layout", [&] {
        store_->wait({key("layout")}, o_.rdzv.timeout);
        return text_of(store_->get(key("layout")));
      });
      const std::string ours = layout_text(weights);
      UNIRL_CHECK(theirs == ours, "c10d_transport::fetch: rank ", rank_, " holds ", ours,
                  " but the learner publishes ", theirs, ": expected the same model on every rank");
      plan_ = plan(weights);
    }
    check_layout(weights, "fetch");
    if (joined_ < 0) joined_ = toward_learner("reading the first version", [&] { return first_published(); }) - 1;
    join_until(newest, &weights);
    (void)have;  // every version is received (the learner sends each); the newest is copied
    return joined_;
  }

  bool push(versioned_batch<Batch> b) {
    UNIRL_CHECK(!is_learner(), "c10d_transport::push: rank 0 is the learner: samplers push batches");
    if (left_) return false;
    if (toward_learner("pushing a batch", [&] { return store_->check({key("stop")}); })) {
      leave();
      return false;
    }
    watch_learner("pushing a batch");
    const torch::Tensor bytes = wire::encode(b);
    send_header(1, bytes.numel(), b.policy_version);
    toward_learner("sending a batch", [&] {
      std::vector<torch::Tensor> one{bytes};
      group_->send(one, 0, tag_data)->wait(o_.rdzv.timeout);
      return 0;
    });
    return true;
  }

  /// A sampler leaves: receives the versions it has not received and says goodbye (once).
  void leave() {
    if (is_learner() || left_) return;
    left_ = true;
    if (!plan_.empty()) join_until(toward_learner("leaving", [&] { return published(); }), nullptr);
    send_header(2, 0, 0);
  }

 private:
  static constexpr int tag_header = 71, tag_data = 72, tag_weights = 73;
  using work_ptr = c10::intrusive_ptr<c10d::Work>;
  using clock = std::chrono::steady_clock;

  // The constructors' checks of the rank, world and options (before any store is opened).
  void check_settings() {
    UNIRL_CHECK(world_ >= 2, "c10d_transport: world_size = ", world_,
                ": expected >= 2 (rank 0 learns, ranks 1.. sample)");
    UNIRL_CHECK(rank_ >= 0 && rank_ < world_, "c10d_transport: rank = ", rank_, ": expected in [0, ", world_, ")");
    UNIRL_CHECK(o_.max_staleness >= 0, "c10d_transport: max_staleness = ", o_.max_staleness, ": expected >= 0");
    UNIRL_CHECK(o_.bucket_bytes > 0, "c10d_transport: bucket_bytes = ", o_.bucket_bytes, ": expected > 0");
    UNIRL_CHECK(o_.fault_timeout.count() > 0, "c10d_transport: fault_timeout = ", o_.fault_timeout.count(),
                " ms: expected > 0");
    UNIRL_CHECK(o_.heartbeat.count() >= 0 && o_.heartbeat < o_.fault_timeout, "c10d_transport: heartbeat = ",
                o_.heartbeat.count(), " ms: expected in [0, fault_timeout = ", o_.fault_timeout.count(), " ms)");
    if (o_.heartbeat.count() == 0) o_.heartbeat = std::max(std::chrono::milliseconds(1), o_.fault_timeout / 10);
  }

  // Joins the world on `store`: its Gloo group and this rank's heartbeat.
  void join(c10::intrusive_ptr<c10d::Store> store) {
    store_ = std::move(store);
    store_->setTimeout(o_.rdzv.timeout);
    group_ = Backend::create(store_, rank_, world_, o_.rdzv);
    live_ = world_ - 1;
    received_.assign(static_cast<std::size_t>(world_), 0);
    gone_.assign(static_cast<std::size_t>(world_), false);
    delivered_.assign(static_cast<std::size_t>(world_), -1);
    seen_.assign(static_cast<std::size_t>(world_), {-1, {}});
    heart_ = std::make_unique<heart>(store_, key("beat") + "/" + std::to_string(rank_), o_.heartbeat);
  }


  struct bucket {
    std::size_t first = 0, last = 0;  // tensors [first, last)
    torch::ScalarType dtype = torch::kFloat;
    std::int64_t numel = 0, bytes = 0;
  };
  struct flight {
    std::int64_t version = 0;
    std::vector<torch::Tensor> buffers;
    std::vector<std::vector<work_ptr>> works;  // per sampler rank
  };

  // Bumps this rank's heartbeat counter every `period` on a thread of its own; a failing store
  // (the learner's TCPStore gone) ends the thread and is remembered.
  class heart {
   public:
    heart(c10::intrusive_ptr<c10d::Store> store, std::string key, std::chrono::milliseconds period)
        : store_(std::move(store)), key_(std::move(key)), period_(period) {
      store_->add(key_, 1);  // alive from the start
      thread_ = std::thread([this] { run(); });
    }
    heart(const heart&) = delete;
    heart& operator=(const heart&) = delete;
    ~heart() {
      {
        std::lock_guard<std::mutex> l(m_);
        stop_ = true;
      }
      cv_.notify_all();
      thread_.join();
    }
    /// Why the store stopped answering ("" while it answers).
    std::string failure() const {
      std::lock_guard<std::mutex> l(m_);
      return failure_;
    }

   private:
    void run() {
      std::unique_lock<std::mutex> l(m_);
      while (!cv_.wait_for(l, period_, [this] { return stop_; })) {
        l.unlock();
        std::string failed;
        try {
          store_->add(key_, 1);
        } catch (const std::exception& e) {
          failed = message_of(e);
        }
        l.lock();
        if (!failed.empty()) {
          failure_ = failed;
          return;
        }
      }
    }
    c10::intrusive_ptr<c10d::Store> store_;
    std::string key_;
    std::chrono::milliseconds period_;
    mutable std::mutex m_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::string failure_;
    std::thread thread_;
  };

  static std::string message_of(const std::exception& e) {
    if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
    return e.what();
  }

  static torch::ScalarType wire_dtype(const torch::Tensor& t) {
    return t.scalar_type() == torch::kBool ? torch::kUInt8 : t.scalar_type();  // bool travels as uint8
  }

  std::vector<bucket> plan(const std::vector<torch::Tensor>& ws) const {
    std::vector<bucket> out;
    for (std::size_t i = 0; i < ws.size(); ++i) {
      const auto d = wire_dtype(ws[i]);
      const std::int64_t b = ws[i].numel() * static_cast<std::int64_t>(c10::elementSize(d));
      if (out.empty() || out.back().dtype != d || out.back().bytes + b > o_.bucket_bytes)
        out.push_back({i, i, d, 0, 0});
      out.back().last = i + 1;
      out.back().numel += ws[i].numel();
      out.back().bytes += b;
    }
    return out;
  }

  static std::string layout_text(const std::vector<torch::Tensor>& ws) {
    std::string s = std::to_string(ws.size()) + " tensors:";
    for (const auto& w : ws) s += " " + std::string(c10::toString(w.scalar_type())) + "[" + std::to_string(w.numel()) + "]";
    return s;
  }

  void check_layout(const std::vector<torch::Tensor>& ws, const char* where) const {
    UNIRL_CHECK(!plan_.empty() && plan_.back().last == ws.size(), "c10d_transport::", where, ": ", ws.size(),
                " tensors: expected ", plan_.empty() ? 0 : plan_.back().last, " (the same model every time)");
  }

  static torch::Tensor flatten(const std::vector<torch::Tensor>& ws, const bucket& b) {
    std::vector<torch::Tensor> flat;
    for (std::size_t i = b.first; i < b.last; ++i)
      flat.push_back(ws[i].detach().reshape({-1}).to(torch::kCPU, b.dtype));
    return torch::cat(flat).contiguous();
  }

  // ---- faults ----

  // The learner: sampler `r` is lost. stop: throws (after telling the samplers); carry_on: it
  // is no longer sent to nor waited for.
  void lose(int r, const std::string& why) {
    const auto i = static_cast<std::size_t>(r);
    if (gone_[i]) return;
    if (o_.on_sampler_loss == sampler_loss::stop) {
      const std::string what = ::unirl::detail::concat(
          "unirl: c10d_transport: the learner lost sampler rank ", r, ": ", why, " (on_sampler_loss = stop; ",
          "fault_timeout = ", o_.fault_timeout.count(), " ms)");
      try {
        store_->set(key("abort"), bytes_of(what));
      } catch (const std::exception&) {
      }
      throw error(what);
    }
    gone_[i] = true;
    --live_;
    lost_.push_back(r);
    UNIRL_CHECK(live_ > 0 || finished_, "c10d_transport: the learner lost sampler rank ", r, ", its last: ", why,
                " (fault_timeout = ", o_.fault_timeout.count(), " ms): no sampler left to learn from");
    for (auto& f : flights_) {  // sends to a dead peer are never waited for
      for (auto& w : f.works[i]) abandoned_.push_back(std::move(w));
      f.works[i].clear();
    }
  }

  // The learner: checks the live samplers' heartbeats (at most every heartbeat / 2).
  void watch_samplers() {
    const auto now = clock::now();
    if (now < next_watch_) return;
    next_watch_ = now + o_.heartbeat / 2;
    for (int r = 1; r < world_; ++r) {
      if (gone_[static_cast<std::size_t>(r)]) continue;
      const std::int64_t beat = peek(key("beat") + "/" + std::to_string(r));
      if (const auto quiet = stale(r, beat, now))
        lose(r, ::unirl::detail::concat("no heartbeat for ", *quiet, " ms"));
    }
  }

  // Milliseconds rank r's counter has stood still, when that is longer than fault_timeout.
  std::optional<std::int64_t> stale(int r, std::int64_t beat, clock::time_point now) {
    auto& [value, since] = seen_[static_cast<std::size_t>(r)];
    if (beat != value) {
      value = beat;
      since = now;
      return std::nullopt;
    }
    const auto quiet = std::chrono::duration_cast<std::chrono::milliseconds>(now - since);
    if (quiet <= o_.fault_timeout) return std::nullopt;
    return quiet.count();
  }

  // A sampler: the learner is gone when its store fails, its heartbeat stood still for
  // fault_timeout, or it aborted (at most every heartbeat / 2).
  void watch_learner(const char* doing) {
    const auto now = clock::now();
    if (now < next_watch_) return;
    next_watch_ = now + o_.heartbeat / 2;
    const std::string failed = heart_->failure();
    if (!failed.empty()) learner_gone(doing, "its store does not answer (" + failed + ")");
    const auto beat = toward_learner(doing, [&] { return peek(key("beat") + "/0"); });
    if (const auto quiet = stale(0, beat, now))
      learner_gone(doing, ::unirl::detail::concat("no heartbeat for ", *quiet, " ms"));
    const bool aborted = toward_learner(doing, [&] { return store_->check({key("abort")}); });
    if (aborted) {
      const std::string why = toward_learner(doing, [&] { return text_of(store_->get(key("abort"))); });
      throw error(::unirl::detail::concat("unirl: c10d_transport: rank ", rank_, ": the learner (rank 0) stopped: ",
                                          why));
    }
  }

  [[noreturn]] void learner_gone(const char* doing, const std::string& why) const {
    throw error(::unirl::detail::concat("unirl: c10d_transport: rank ", rank_, " lost the learner (rank 0) while ",
                                        doing, ": ", why, " (fault_timeout = ", o_.fault_timeout.count(), " ms)"));
  }

  // A sampler's store or Gloo call toward the learner: a failure means the learner is gone.
  template <class F>
  auto toward_learner(const char* doing, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const ::unirl::error&) {
      throw;
    } catch (const std::exception& e) {
      learner_gone(doing, message_of(e));
    }
  }

  // ---- the learner's waits ----

  // Waits until every live sampler received the oldest version in flight. A sampler may be
  // blocked sending a batch (a send completes when the learner receives it) before it can
  // receive: the samplers announce each send in the store (`sending/<rank>`), and the learner
  // receives the announced ones into its inbox while it waits, so neither side waits for the
  // other forever.
  void complete_oldest() {
    const std::int64_t v = flights_.front().version;
    const auto deadline = clock::now() + o_.rdzv.timeout;
    for (;;) {
      bool all = true;
      for (int r = 1; r < world_; ++r) {
        if (gone_[static_cast<std::size_t>(r)]) continue;  // said goodbye (after receiving every version) or lost
        if (counter("joined", r) >= v) continue;
        all = false;
        if (announced(r) > received_[static_cast<std::size_t>(r)]) {
          auto b = receive(r);
          if (b) inbox_.push_back(std::move(*b));
        }
      }
      if (all) break;
      watch_samplers();
      UNIRL_CHECK(clock::now() < deadline, "c10d_transport::publish: the samplers did not ",
                  "receive weight version ", v, " within the timeout (", o_.rdzv.timeout.count(), " ms)");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    auto& f = flights_.front();
    for (int r = 1; r < world_; ++r) {
      const auto i = static_cast<std::size_t>(r);
      for (auto& w : f.works[i]) {
        if (gone_[i]) break;
        try {
          w->wait(o_.rdzv.timeout);
        } catch (const std::exception& e) {
          lose(r, "sending weights failed: " + message_of(e));
        }
      }
    }
    flights_.pop_front();
  }

  // The next message any live sampler announced (round robin): a batch, or nullopt for a
  // goodbye or a lost sampler. Watches the heartbeats meanwhile.
  std::optional<versioned_batch<Batch>> receive_next() {
    const auto deadline = clock::now() + o_.rdzv.timeout;
    for (;;) {
      for (int k = 0; k < world_ - 1; ++k) {
        const int r = 1 + (next_source_ + k) % (world_ - 1);
        if (gone_[static_cast<std::size_t>(r)]) continue;
        if (announced(r) > received_[static_cast<std::size_t>(r)]) {
          next_source_ = r % (world_ - 1);  // the one after r goes first next time
          return receive(r);
        }
      }
      const auto lost = lost_.size();
      watch_samplers();
      if (live_ == 0 || lost_.size() != lost) return std::nullopt;  // the caller looks again
      UNIRL_CHECK(clock::now() < deadline, "c10d_transport::pop: no sampler sent a batch within the timeout (",
                  o_.rdzv.timeout.count(), " ms; ", live_, " live samplers)");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Synchronous: every live sampler delivered its batch of version `current` (none can come).
  bool all_delivered(std::int64_t current) const {
    for (int r = 1; r < world_; ++r)
      if (!gone_[static_cast<std::size_t>(r)] && delivered_[static_cast<std::size_t>(r)] < current) return false;
    return true;
  }

  std::int64_t announced(int r) { return peek(key("sending") + "/" + std::to_string(r)); }

  // A counter's value (0 when unset) without writing: one `add(k, 0)` on a TCPStore (in memory),
  // `check` + `get` on others (a FileStore appends every add to its file).
  std::int64_t peek(const std::string& k) {
    if (o_.rdzv.file_path.empty()) return store_->add(k, 0);  // a TCPStore (maybe under a prefix)
    if (!store_->check({k})) return 0;
    const std::string t = text_of(store_->get(k));
    try {
      return std::stoll(t);
    } catch (const std::exception&) {
      throw error(::unirl::detail::concat("unirl: c10d_transport: store key ", k, " = '", t, "' is not a number"));
    }
  }

  std::int64_t counter(const char* what, int r) {
    const std::string k = key(what) + "/" + std::to_string(r);
    if (!store_->check({k})) return -1;
    const std::string t = text_of(store_->get(k));
    try {
      return std::stoll(t);
    } catch (const std::exception&) {
      throw error(::unirl::detail::concat("unirl: c10d_transport: store key ", k, " = '", t, "' is not a number"));
    }
  }

  // ---- the samplers' side ----

  // Receives versions joined_+1 .. upto; copies the last into `weights` when given.
  void join_until(std::int64_t upto, const std::vector<torch::Tensor>* weights) {
    torch::NoGradGuard no_grad;
    while (joined_ < upto) {
      std::vector<torch::Tensor> bufs;
      toward_learner("receiving weights", [&] {
        std::vector<work_ptr> works;
        for (const auto& b : plan_) {
          bufs.push_back(torch::empty({b.numel}, torch::TensorOptions(b.dtype)));
          std::vector<torch::Tensor> one{bufs.back()};
          works.push_back(group_->recv(one, 0, tag_weights));
        }
        for (auto& w : works) w->wait(o_.rdzv.timeout);
        ++joined_;
        store_->set(key("joined") + "/" + std::to_string(rank_), bytes_of(std::to_string(joined_)));
        return 0;
      });
      if (joined_ == upto && weights) {
        for (std::size_t k = 0; k < plan_.size(); ++k) {
          std::int64_t at = 0;
          for (std::size_t i = plan_[k].first; i < plan_[k].last; ++i) {
            const auto& t = (*weights)[i];
            t.detach().copy_(bufs[k].slice(0, at, at + t.numel()).view(t.sizes()));
            at += t.numel();
          }
        }
      }
    }
  }

  // The version the learner published first (written before the first version number).
  std::int64_t first_published() {
    if (!store_->check({key("first")})) return 0;
    const std::string t = text_of(store_->get(key("first")));
    try {
      return std::stoll(t);
    } catch (const std::exception&) {
      throw error(::unirl::detail::concat("unirl: c10d_transport: store key ", key("first"), " = '", t,
                                          "' is not a version number"));
    }
  }

  std::int64_t published() {
    if (!store_->check({key("version")})) return -1;
    const std::string t = text_of(store_->get(key("version")));
    try {
      return std::stoll(t);
    } catch (const std::exception&) {
      throw error(::unirl::detail::concat("unirl: c10d_transport: store key ", key("version"), " = '", t,
                                          "' is not a version number"));
    }
  }

  void send_header(std::int64_t kind, std::int64_t bytes, std::int64_t version) {
    toward_learner(kind == 2 ? "saying goodbye" : "sending a batch", [&] {
      store_->set(key("sending") + "/" + std::to_string(rank_), bytes_of(std::to_string(++sent_)));
      std::vector<torch::Tensor> h{torch::tensor({kind, bytes, version}, torch::kInt64)};
      group_->send(h, 0, tag_header)->wait(o_.rdzv.timeout);
      return 0;
    });
  }

  // The learner: one message from sampler `src` (announced): a batch, or nullopt for a goodbye
  // or a loss (a failed receive: the sampler is lost).
  std::optional<versioned_batch<Batch>> receive(int src) {
    std::vector<torch::Tensor> h{torch::zeros({3}, torch::kInt64)};
    try {
      group_->recv(h, src, tag_header)->wait(o_.rdzv.timeout);
    } catch (const std::exception& e) {
      lose(src, "receiving a message failed: " + message_of(e));
      return std::nullopt;
    }
    const auto kind = h[0][0].item<std::int64_t>(), n = h[0][1].item<std::int64_t>(),
               version = h[0][2].item<std::int64_t>();
    ++received_[static_cast<std::size_t>(src)];
    if (kind == 2) {
      UNIRL_CHECK(!gone_[static_cast<std::size_t>(src)], "c10d_transport: rank ", src, " said goodbye twice");
      gone_[static_cast<std::size_t>(src)] = true;
      --live_;
      return std::nullopt;
    }
    UNIRL_CHECK(kind == 1, "c10d_transport: header from rank ", src, " has kind ", kind, ": expected 1 (batch) or 2 (goodbye)");
    UNIRL_CHECK(n > 0 && n <= o_.max_batch_bytes, "c10d_transport: batch from rank ", src, " announces ", n,
                " bytes: expected in [1, max_batch_bytes = ", o_.max_batch_bytes, "]");
    std::vector<torch::Tensor> data{torch::empty({n}, torch::kUInt8)};
    try {
      group_->recv(data, src, tag_data)->wait(o_.rdzv.timeout);
    } catch (const std::exception& e) {
      lose(src, "receiving a batch failed: " + message_of(e));
      return std::nullopt;
    }
    auto b = wire::decode<Batch>(data[0], "rank " + std::to_string(src));
    UNIRL_CHECK(b.policy_version == version, "c10d_transport: batch from rank ", src, " says version ", b.policy_version,
                " but its header ", version, ": expected equal");
    b.source = src;
    auto& d = delivered_[static_cast<std::size_t>(src)];
    d = std::max(d, b.policy_version);
    return b;
  }

  static std::string key(const char* k) { return std::string("unirl/rt/") + k; }
  static std::vector<std::uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
  static std::string text_of(const std::vector<std::uint8_t>& v) { return {v.begin(), v.end()}; }

  int rank_ = 0, world_ = 1;
  transport_options o_;
  c10::intrusive_ptr<c10d::Store> store_;
  using group_ptr = decltype(Backend::create(std::declval<const c10::intrusive_ptr<c10d::Store>&>(), 0, 0,
                                            std::declval<const rendezvous&>()));
  group_ptr group_;
  std::vector<bucket> plan_;
  std::deque<flight> flights_;
  std::vector<work_ptr> abandoned_;             // sends to lost samplers (never waited for)
  std::deque<versioned_batch<Batch>> inbox_;    // batches received while waiting for a version's receipts
  std::vector<std::int64_t> received_;          // headers received per rank
  std::vector<std::int64_t> delivered_;         // newest batch version received per rank
  std::vector<bool> gone_;                      // ranks that said goodbye or were lost
  std::vector<int> lost_;                       // ranks lost (sampler_loss::carry_on)
  std::vector<std::pair<std::int64_t, clock::time_point>> seen_;  // last heartbeat value per rank, since
  clock::time_point next_watch_{};
  std::int64_t sent_ = 0;                       // headers sent (a sampler)
  std::int64_t published_ = -1, joined_ = -1, dropped_ = 0;
  int live_ = 0, next_source_ = 0;
  bool finished_ = false, left_ = false;
  std::unique_ptr<heart> heart_;                // last: stops before the store goes
};

}  // namespace unirl::parallel
