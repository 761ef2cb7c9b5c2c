#pragma once
/// \file reward_ranks.hpp
/// The roles of a learner / sampler deployment (docs/parallel.md, "Reward overlap and reward
/// ranks"): of `WORLD_SIZE` processes, ranks 0 .. `learner_ranks - 1` learn (data parallel among
/// themselves), the next ones up to `WORLD_SIZE - reward_ranks - 1` sample, and the last
/// `reward_ranks` host a `rewards::reward_server` each. The reward ranks are not in the c10d world
/// (they join no weight send): they reach the world's TCP store as clients only, to publish their
/// server's URL (`unirl/reward/<index>`); samplers read it and score with `rewards::remote_scorer`
/// (with `worker_options::overlap_scoring`, its `submit`).
///
/// Several learners (`learner_ranks` = L > 1): sampler s (0-based among the samplers,
/// `sampler_index()`) belongs to learner s % L. Each learner and its samplers form a
/// `c10d_transport` world of their own (the learner its rank 0, its samplers ranks 1.. in order
/// of s), and the learners form a `data_parallel` group (`learner_group()`, rank = learner
/// index): each learner trains on its own samplers' batches, the trainer averages the gradients
/// over the learners, so their weights stay equal. All of these live on the deployment's one
/// store (served by rank 0; each group under a `c10d::PrefixStore`: `unirl/g<g>`,
/// `unirl/learners`). Rank 0 serves the store: the learners meet at a barrier after `finish` so
/// that it ends last. With one learner everything is as before (the transport opens the store).
///
/// ```cpp
/// // RANK, WORLD_SIZE (all processes), MASTER_ADDR, MASTER_PORT as a launcher sets them
/// auto d = unirl::parallel::deployment::from_environment({.learner_ranks = 2, .reward_ranks = 1});
/// if (d.is_reward()) { d.serve_reward(my_json_scorer{}); return 0; }   // until the learners finish
/// auto tr = d.transport<unirl::token_rollout>({.max_staleness = 0});  // this rank's learner group
/// if (d.is_learner()) {
///   using dp = unirl::parallel::data_parallel<unirl::parallel::gloo>;
///   unirl::trainer<M, A, R, dp> t{model, reward, opts, d.learner_group()};
///   unirl::parallel::learner l{t, tr};
///   for (int s = 0; s < steps; ++s) l.step(tr.samplers());
///   l.finish();
///   t.parallel().barrier();  // rank 0 serves the store: every learner has finished before it ends
/// } else {
///   unirl::rewards::remote_scorer remote{{.url = d.reward_url(d.reward_for_sampler(d.sampler_index()))}};
///   unirl::parallel::rollout_worker<M, A, unirl::rewards::remote_scorer, decltype(tr)> w{
///       model, remote, opts, tr, d.sampler_index(), {.overlap_scoring = true}};
///   while (w.run_once(next())) {}
/// }
/// ```
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/parallel/c10d_transport.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/rewards/server.hpp>

namespace unirl::parallel {

/// How a deployment's processes divide into roles.
struct deployment_options {
  std::int64_t learner_ranks = 1;  // the first ranks learn (data parallel among themselves)
  std::int64_t reward_ranks = 0;   // the last ranks host reward servers (outside the c10d world)

  void validate(const std::string& prefix) const {
    options::require(learner_ranks >= 1, prefix + "learner_ranks", learner_ranks, ">= 1");
    options::require(reward_ranks >= 0, prefix + "reward_ranks", reward_ranks, ">= 0");
  }
};

/// Settings of a reward rank's server.
struct reward_rank_options {
  rewards::server_options server{};  // host to listen on, port (0: ephemeral), threads, ...
  std::string advertise_host{};      // the host samplers connect to; empty: server.host, or this
                                     // machine's hostname when server.host is "0.0.0.0"
  double poll_s = 0.1;               // how often the rank looks whether the learners finished

  void validate(const std::string& prefix) const {
    options::require(poll_s > 0, prefix + "poll_s", poll_s, "> 0");
  }
};

}  // namespace unirl::parallel
BOOST_HANA_ADAPT_STRUCT(unirl::parallel::deployment_options, learner_ranks, reward_ranks);
BOOST_HANA_ADAPT_STRUCT(unirl::parallel::reward_rank_options, server, advertise_host, poll_s);
namespace unirl::parallel {

/// The roles of one process of a deployment (see the file comment).
class deployment {
 public:
  deployment(int rank, int world_size, deployment_options o = {}, rendezvous r = {})
      : rank_(rank), world_(world_size), o_(o), r_(std::move(r)) {
    ::unirl::options::validate(o_);
    UNIRL_CHECK(world_size - o_.reward_ranks >= 2, "deployment: world_size = ", world_size, " with reward_ranks = ",
                o_.reward_ranks, ": expected at least a learner and a sampler besides the reward ranks");
    UNIRL_CHECK(world_size - o_.reward_ranks >= 2 * o_.learner_ranks, "deployment: learner_ranks = ",
                o_.learner_ranks, " with world_size = ", world_size, " and reward_ranks = ", o_.reward_ranks, ": ",
                world_size - o_.reward_ranks - o_.learner_ranks, " sampler ranks; expected at least one per learner ",
                "(world_size - reward_ranks >= 2 * learner_ranks)");
    UNIRL_CHECK(rank >= 0 && rank < world_size, "deployment: rank = ", rank, ": expected in [0, ", world_size, ")");
    UNIRL_CHECK(o_.reward_ranks == 0 || r_.file_path.empty(), "deployment: rendezvous file_path = '", r_.file_path,
                "' with reward ranks: expected a TCP store (reward ranks join it as clients)");
  }

  /// Reads RANK, WORLD_SIZE (every process, reward ranks included), MASTER_ADDR, MASTER_PORT.
  static deployment from_environment(deployment_options o = {}, rendezvous r = {}) {
    const auto [rank, world] = read_launch_environment("deployment", r);
    return deployment(rank, world, o, std::move(r));
  }

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  /// The processes in the c10d world (learners and samplers): `world_size() - reward_ranks`.
  int c10d_world_size() const { return world_ - static_cast<int>(o_.reward_ranks); }
  int learners() const { return static_cast<int>(o_.learner_ranks); }
  int samplers() const { return c10d_world_size() - learners(); }
  int reward_ranks() const { return static_cast<int>(o_.reward_ranks); }
  bool is_learner() const { return rank_ < learners(); }
  bool is_sampler() const { return rank_ >= learners() && rank_ < c10d_world_size(); }
  bool is_reward() const { return rank_ >= c10d_world_size(); }
  /// This sampler's index in [0, samplers()): its stream (`rollout_worker`'s seed offset) and
  /// the argument of `reward_for_sampler`.
  int sampler_index() const {
    UNIRL_CHECK(is_sampler(), "deployment::sampler_index: rank ", rank_, " is not a sampler rank (those are ",
                learners(), "..", c10d_world_size() - 1, ")");
    return rank_ - learners();
  }
  /// The learner group of a learner or sampler rank: the learner's index in [0, learners()); a
  /// sampler's learner (`sampler_index() % learners()`).
  int group() const {
    UNIRL_CHECK(!is_reward(), "deployment::group: rank ", rank_, " is a reward rank: it is in no learner group");
    return is_learner() ? rank_ : sampler_index() % learners();
  }
  /// The samplers of learner group `g`.
  int group_samplers(int g) const {
    UNIRL_CHECK(g >= 0 && g < learners(), "deployment::group_samplers: g = ", g, ": expected in [0, ", learners(), ")");
    return (samplers() - g + learners() - 1) / learners();
  }
  /// This reward rank's index in [0, reward_ranks).
  int reward_index() const {
    UNIRL_CHECK(is_reward(), "deployment::reward_index: rank ", rank_, " is not a reward rank (those are ",
                c10d_world_size(), "..", world_ - 1, ")");
    return rank_ - c10d_world_size();
  }
  /// The reward rank sampler `stream` (0-based) uses: round robin.
  int reward_for_sampler(std::int64_t stream) const {
    UNIRL_CHECK(o_.reward_ranks > 0, "deployment::reward_for_sampler: the deployment has no reward ranks");
    return static_cast<int>(stream % o_.reward_ranks);
  }
  const rendezvous& rdzv() const { return r_; }

  /// The transport of a learner or a sampler (`o.rdzv`'s host, port and file are replaced by the
  /// deployment's). One learner: a c10d world of `c10d_world_size()` ranks, which opens the
  /// deployment's store. Several: the world of this rank's learner group (`group()`): its learner
  /// (rank 0) and its `group_samplers(group())` samplers (ranks 1.., in order of
  /// `sampler_index()`), on the deployment's store under the prefix `unirl/g<group>`.
  template <class Batch, class Backend = gloo>
  c10d_transport<Batch, Backend> transport(transport_options o = {}) const {
    UNIRL_CHECK(!is_reward(), "deployment::transport: rank ", rank_, " is a reward rank: it joins no c10d world");
    o.rdzv.host = r_.host;
    o.rdzv.port = r_.port;
    o.rdzv.file_path = r_.file_path;
    if (learners() == 1) return c10d_transport<Batch, Backend>(rank_, c10d_world_size(), std::move(o));
    const int g = group(), local = is_learner() ? 0 : 1 + sampler_index() / learners();
    return c10d_transport<Batch, Backend>(c10::make_intrusive<c10d::PrefixStore>(group_prefix(g), shared_store()),
                                          local, 1 + group_samplers(g), std::move(o));
  }

  /// The learners' data-parallel strategy (a learner rank only): rank = learner index, world =
  /// `learners()`, on the deployment's store under the prefix `unirl/learners` (`r`'s host, port
  /// and file are the deployment's; its timeout, Gloo interface and broadcast_every apply). One
  /// learner: a group of one (nothing is exchanged; its store is in memory). Give it to the
  /// trainer: `trainer<M, A, R, data_parallel<gloo>> t{model, reward, opts, d.learner_group()}`,
  /// or wrapped, `parallel::zero<gloo>{d.learner_group()}`.
  template <class Backend = gloo>
  data_parallel<Backend> learner_group(data_parallel_options o = {}) const {
    UNIRL_CHECK(is_learner(), "deployment::learner_group: rank ", rank_, " is not a learner rank (those are 0..",
                learners() - 1, ")");
    rendezvous r = r_;
    if (learners() == 1) return data_parallel<Backend>(c10::make_intrusive<c10d::HashStore>(), 0, 1, std::move(r), std::move(o));
    return data_parallel<Backend>(c10::make_intrusive<c10d::PrefixStore>("unirl/learners", shared_store()), rank_,
                                  learners(), std::move(r), std::move(o));
  }

  /// The URL reward rank `index` published, waiting for it up to `rdzv().timeout`.
  std::string reward_url(int index) const {
    UNIRL_CHECK(index >= 0 && index < o_.reward_ranks, "deployment::reward_url: index = ", index, ": expected in [0, ",
                o_.reward_ranks, ")");
    auto store = client();
    const std::string k = url_key(index);
    store->wait({k}, r_.timeout);
    const auto v = store->get(k);
    std::string url(v.begin(), v.end());
    UNIRL_CHECK(url.rfind("http://", 0) == 0 && url.size() < 2048, "deployment::reward_url: store key ", k, " = '",
                url.substr(0, 200), "': expected an http:// URL");
    return url;
  }

  /// A reward rank's life: hosts `scorer` (a scorer of `rewards::json_batch`) on a
  /// `rewards::reward_server`, publishes its URL, and serves until the learner has finished (its
  /// transport's `finish` returned: its samplers said goodbye, key `unirl/rt/finished`; with
  /// several learners, every learner) or the store goes away (rank 0 exited). Returns the
  /// requests served.
  template <class Scorer>
  std::int64_t serve_reward(Scorer scorer, reward_rank_options o = {}) const {
    ::unirl::options::validate(o);
    const int index = reward_index();
    rewards::reward_server server(std::move(scorer), o.server);
    server.start();
    std::string host = o.advertise_host;
    if (host.empty()) host = o.server.host;
    if (host == "0.0.0.0") {
      char name[256] = {};
      UNIRL_CHECK(gethostname(name, sizeof(name) - 1) == 0, "deployment::serve_reward: gethostname failed; set ",
                  "reward_rank_options::advertise_host");
      host = name;
    }
    const std::string url = "http://" + host + ":" + std::to_string(server.port()) + o.server.path;
    auto store = client();
    store->set(url_key(index), std::vector<std::uint8_t>(url.begin(), url.end()));
    std::vector<c10::intrusive_ptr<c10d::Store>> groups;  // where each learner marks that it finished
    if (learners() == 1) groups.push_back(store);
    else
      for (int g = 0; g < learners(); ++g) groups.push_back(c10::make_intrusive<c10d::PrefixStore>(group_prefix(g), store));
    const auto poll = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::duration<double>(o.poll_s));
    for (;;) {
      try {
        if (std::all_of(groups.begin(), groups.end(), [](const auto& s) { return s->check({stop_key}); })) break;
      } catch (const std::exception&) {
        break;  // the store (served by the learner) is gone: the run is over
      }
      std::this_thread::sleep_for(poll);
    }
    server.stop();
    return server.served();
  }

 private:
  // What c10d_transport::finish sets once its samplers said goodbye (parallel/c10d_transport.hpp):
  // after it no sampler of that learner scores again.
  static constexpr const char* stop_key = "unirl/rt/finished";
  static std::string url_key(int index) { return "unirl/reward/" + std::to_string(index); }
  static std::string group_prefix(int g) { return "unirl/g" + std::to_string(g); }

  // The deployment's store with several learners, opened once (rank 0 serves a TCPStore that
  // waits for every rank of the c10d world) and shared by the learner groups and the learners'
  // data-parallel group.
  c10::intrusive_ptr<c10d::Store> shared_store() const {
    if (!*store_) {
      *store_ = open_world_store(r_, rank_, c10d_world_size());
      (*store_)->setTimeout(r_.timeout);
    }
    return *store_;
  }

  // A connection to the deployment's TCP store that does not count as one of its workers.
  c10::intrusive_ptr<c10d::Store> client() const {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(r_.port);
    so.isServer = false;
    so.waitWorkers = false;
    so.timeout = r_.timeout;
    use_classic_tcpstore(so);
    return c10::make_intrusive<c10d::TCPStore>(r_.host, so);
  }

  int rank_ = 0, world_ = 1;
  deployment_options o_;
  rendezvous r_;
  // Several learners: the shared store, opened on first use (shared_store); copies of this
  // deployment share it.
  std::shared_ptr<c10::intrusive_ptr<c10d::Store>> store_ = std::make_shared<c10::intrusive_ptr<c10d::Store>>();
};

}  // namespace unirl::parallel
