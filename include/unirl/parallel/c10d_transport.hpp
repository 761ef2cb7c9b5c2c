#pragma once
/// \file c10d_transport.hpp
/// The rollout transport over one PyTorch c10d world: rank 0 is the learner, ranks 1..N are
/// samplers. Weights go learner → samplers by bucketed, versioned broadcasts on the world's
/// process group (host buffers: a Gloo group; models on CUDA are copied to and from them);
/// scored batches go sampler → learner
/// by point-to-point send / receive of their encoded bytes (parallel/wire.hpp); the version
/// counter and the stop flag live in the world's store (a TCPStore served by rank 0 from
/// torchrun-style variables, or a FileStore). Nothing travels outside c10d.
///
/// ```cpp
/// // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them
/// auto tr = unirl::parallel::c10d_transport<unirl::token_rollout>::from_environment({.max_staleness = 2});
/// if (tr.is_learner()) { unirl::parallel::learner l{trainer, tr}; while (...) l.step(tr.samplers()); l.finish(); }
/// else { unirl::parallel::rollout_worker<...> w{model, reward, opts, tr, tr.rank() - 1}; while (w.run_once(in)) {} }
/// ```
/// Protocol. `publish(w, v)` (learner) writes `v` to the store key `unirl/rt/version`, then
/// starts one broadcast per bucket (consecutive tensors of one dtype, at most `bucket_bytes`
/// each — a larger tensor is a bucket of its own) and keeps at most `max_staleness` versions in
/// flight (0: it waits until every sampler received them). A sampler's `fetch` joins every
/// published version it has not joined, in order (collectives must match on every rank), and
/// copies the newest into its model. `push` sends a 3-int64 header (kind, bytes, version) then
/// the bytes; `pop` receives from any sampler, drops batches older than `max_staleness`
/// versions, and returns the next one. `finish` (learner) sets `unirl/rt/stop`, receives and
/// discards until every sampler said goodbye (each joins the remaining versions first), and
/// waits for the broadcasts in flight. Every wait is bounded by `rendezvous::timeout`.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/transport.hpp>
#include <unirl/core/error.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/wire.hpp>

namespace unirl::parallel {

/// Settings of `c10d_transport`.
struct transport_options {
  rendezvous rdzv{};                            // store (TCP or file), Gloo interface, timeout
  std::int64_t max_staleness = 0;               // versions a popped batch may be behind; 0: synchronous
  std::int64_t bucket_bytes = 256LL << 20;      // weight-broadcast bucket size (seed 000: 256 MB)
  std::int64_t max_batch_bytes = 1LL << 32;     // larger batch headers are rejected (untrusted)
};

/// `RolloutTransport` over one c10d world (see the file comment).
template <class Batch, class Backend = gloo>
class c10d_transport {
 public:
  c10d_transport(int rank, int world_size, transport_options o = {}) : rank_(rank), world_(world_size), o_(std::move(o)) {
    UNIRL_CHECK(world_size >= 2, "c10d_transport: world_size = ", world_size,
                ": expected >= 2 (rank 0 learns, ranks 1.. sample)");
    UNIRL_CHECK(rank >= 0 && rank < world_size, "c10d_transport: rank = ", rank, ": expected in [0, ", world_size, ")");
    UNIRL_CHECK(o_.max_staleness >= 0, "c10d_transport: max_staleness = ", o_.max_staleness, ": expected >= 0");
    UNIRL_CHECK(o_.bucket_bytes > 0, "c10d_transport: bucket_bytes = ", o_.bucket_bytes, ": expected > 0");
    const auto& r = o_.rdzv;
    store_ = make_store(r, rank, world_size);
    store_->setTimeout(r.timeout);
    group_ = Backend::create(store_, rank, world_size, r);
    live_ = world_size - 1;
    received_.assign(static_cast<std::size_t>(world_size), 0);
    gone_.assign(static_cast<std::size_t>(world_size), false);
  }

  /// Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the variables torchrun sets).
  static c10d_transport from_environment(transport_options o = {}) {
    auto parse = [](const char* name, const std::string& fallback) {
      const char* v = std::getenv(name);
      const std::string text = v ? v : fallback;
      try {
        std::size_t used = 0;
        const int x = std::stoi(text, &used);
        if (used == text.size()) return x;
      } catch (const std::exception&) {
      }
      throw error(::unirl::detail::concat("unirl: c10d_transport: environment variable ", name, " = '", text,
                                          "' is not an integer"));
    };
    if (const char* a = std::getenv("MASTER_ADDR")) o.rdzv.host = a;
    o.rdzv.port = parse("MASTER_PORT", std::to_string(o.rdzv.port));
    const int rank = parse("RANK", "0"), world = parse("WORLD_SIZE", "1");
    return c10d_transport(rank, world, std::move(o));
  }

  c10d_transport(c10d_transport&&) = default;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  bool is_learner() const { return rank_ == 0; }
  /// Sampler ranks (1..world_size-1): the batches a synchronous learner step gathers.
  int samplers() const { return world_ - 1; }
  std::int64_t max_staleness() const { return o_.max_staleness; }
  /// Batches `pop` dropped as older than `max_staleness` versions.
  std::int64_t dropped() const { return dropped_; }
  /// The bucket size in MB (`transport_options::bucket_bytes`).
  double bucket_mb() const { return static_cast<double>(o_.bucket_bytes) / (1 << 20); }
  /// Bytes of weights one `publish` broadcasts (after the first publish or fetch).
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
    }
    check_layout(weights, "publish");
    flight f{version, {}, {}};
    {
      torch::NoGradGuard no_grad;
      for (const auto& b : plan_) f.buffers.push_back(flatten(weights, b));  // a snapshot: training goes on
    }
    store_->set(key("version"), bytes_of(std::to_string(version)));
    for (auto& buf : f.buffers) {
      std::vector<torch::Tensor> one{buf};
      f.works.push_back(group_->broadcast(one, c10d::BroadcastOptions{0}));
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
      } else if (live_ > 0) {
        got = receive(-1);
        if (!got) continue;  // a goodbye
      } else {
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

  /// Stops the samplers: they join the versions in flight, say goodbye and return -1 / false.
  /// Batches still arriving are discarded. Idempotent.
  void finish() {
    if (!is_learner() || finished_) return;
    finished_ = true;
    store_->set(key("stop"), bytes_of("1"));
    inbox_.clear();
    while (live_ > 0) (void)receive(-1);
    while (!flights_.empty()) complete_oldest();
  }

  // ---- samplers (ranks 1..) ----

  std::int64_t fetch(const std::vector<torch::Tensor>& weights, std::int64_t have, std::int64_t wait_for) {
    UNIRL_CHECK(!is_learner(), "c10d_transport::fetch: rank 0 is the learner: samplers fetch weights");
    if (left_) return -1;
    const auto deadline = std::chrono::steady_clock::now() + o_.rdzv.timeout;
    std::int64_t newest = -1;
    for (;;) {
      newest = published();
      if (newest >= wait_for && newest >= 0) break;
      if (store_->check({key("stop")})) {
        leave();
        return -1;
      }
      UNIRL_CHECK(std::chrono::steady_clock::now() < deadline, "c10d_transport::fetch: rank ", rank_,
                  " waited for weight version ", wait_for, " longer than the timeout (",
                  o_.rdzv.timeout.count(), " ms); the newest published is ", newest);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (plan_.empty()) {
      store_->wait({key("layout")}, o_.rdzv.timeout);
      const std::string theirs = text_of(store_->get(key("layout"))), ours = layout_text(weights);
      UNIRL_CHECK(theirs == ours, "c10d_transport::fetch: rank ", rank_, " holds ", ours,
                  " but the learner publishes ", theirs, ": expected the same model on every rank");
      plan_ = plan(weights);
    }
    check_layout(weights, "fetch");
    join_until(newest, &weights);
    (void)have;  // every version is joined (the collectives must match); the newest is copied
    return joined_;
  }

  bool push(versioned_batch<Batch> b) {
    UNIRL_CHECK(!is_learner(), "c10d_transport::push: rank 0 is the learner: samplers push batches");
    if (left_) return false;
    if (store_->check({key("stop")})) {
      leave();
      return false;
    }
    const torch::Tensor bytes = wire::encode(b);
    send_header(1, bytes.numel(), b.policy_version);
    std::vector<torch::Tensor> one{bytes};
    group_->send(one, 0, tag_data)->wait(o_.rdzv.timeout);
    return true;
  }

  /// A sampler leaves: joins the versions it has not joined and says goodbye (once).
  void leave() {
    if (is_learner() || left_) return;
    left_ = true;
    if (!plan_.empty()) join_until(published(), nullptr);
    send_header(2, 0, 0);
  }

 private:
  static constexpr int tag_header = 71, tag_data = 72;

  struct bucket {
    std::size_t first = 0, last = 0;  // tensors [first, last)
    torch::ScalarType dtype = torch::kFloat;
    std::int64_t numel = 0, bytes = 0;
  };
  struct flight {
    std::int64_t version = 0;
    std::vector<torch::Tensor> buffers;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
  };

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

  // Waits until every sampler joined the oldest version in flight. A sampler may be blocked
  // sending a batch (a send completes when the learner receives it) before it can join: the
  // samplers announce each send in the store (`sending/<rank>`), and the learner receives the
  // announced ones into its inbox while it waits, so neither side waits for the other forever.
  void complete_oldest() {
    const std::int64_t v = flights_.front().version;
    const auto deadline = std::chrono::steady_clock::now() + o_.rdzv.timeout;
    for (;;) {
      bool all = true;
      for (int r = 1; r < world_; ++r) {
        if (gone_[static_cast<std::size_t>(r)]) continue;  // it joined every version before its goodbye
        if (counter("joined", r) >= v) continue;
        all = false;
        if (counter("sending", r) > received_[static_cast<std::size_t>(r)]) {
          auto b = receive(r);
          if (b) inbox_.push_back(std::move(*b));
        }
      }
      if (all) break;
      UNIRL_CHECK(std::chrono::steady_clock::now() < deadline, "c10d_transport::publish: the samplers did not ",
                  "receive weight version ", v, " within the timeout (", o_.rdzv.timeout.count(), " ms)");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    for (auto& w : flights_.front().works) w->wait(o_.rdzv.timeout);
    flights_.pop_front();
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

  // Joins versions joined_+1 .. upto; copies the last into `weights` when given.
  void join_until(std::int64_t upto, const std::vector<torch::Tensor>* weights) {
    torch::NoGradGuard no_grad;
    while (joined_ < upto) {
      std::vector<torch::Tensor> bufs;
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (const auto& b : plan_) {
        bufs.push_back(torch::empty({b.numel}, torch::TensorOptions(b.dtype)));
        std::vector<torch::Tensor> one{bufs.back()};
        works.push_back(group_->broadcast(one, c10d::BroadcastOptions{0}));
      }
      for (auto& w : works) w->wait(o_.rdzv.timeout);
      ++joined_;
      store_->set(key("joined") + "/" + std::to_string(rank_), bytes_of(std::to_string(joined_)));
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
    store_->set(key("sending") + "/" + std::to_string(rank_), bytes_of(std::to_string(++sent_)));
    std::vector<torch::Tensor> h{torch::tensor({kind, bytes, version}, torch::kInt64)};
    group_->send(h, 0, tag_header)->wait(o_.rdzv.timeout);
  }

  // One message from sampler `from` (-1: any): a batch, or nullopt for a goodbye.
  std::optional<versioned_batch<Batch>> receive(int from) {
    std::vector<torch::Tensor> h{torch::zeros({3}, torch::kInt64)};
    auto work = from < 0 ? group_->recvAnysource(h, tag_header) : group_->recv(h, from, tag_header);
    work->wait(o_.rdzv.timeout);
    const int src = from < 0 ? work->sourceRank() : from;
    const auto kind = h[0][0].item<std::int64_t>(), n = h[0][1].item<std::int64_t>(),
               version = h[0][2].item<std::int64_t>();
    UNIRL_CHECK(src >= 1 && src < world_, "c10d_transport: a message from rank ", src, ": expected a sampler rank in [1, ",
                world_, ")");
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
    group_->recv(data, src, tag_data)->wait(o_.rdzv.timeout);
    auto b = wire::decode<Batch>(data[0], "rank " + std::to_string(src));
    UNIRL_CHECK(b.policy_version == version, "c10d_transport: batch from rank ", src, " says version ", b.policy_version,
                " but its header ", version, ": expected equal");
    b.source = src;
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
  std::deque<versioned_batch<Batch>> inbox_;    // batches received while waiting for a version's joins
  std::vector<std::int64_t> received_;          // headers received per rank
  std::vector<bool> gone_;                      // ranks that said goodbye
  std::int64_t sent_ = 0;                       // headers sent (a sampler)
  std::int64_t published_ = -1, joined_ = -1, dropped_ = 0;
  int live_ = 0;
  bool finished_ = false, left_ = false;
};

}  // namespace unirl::parallel
