#pragma once
/// \file data_parallel.hpp
/// Data parallelism over PyTorch's c10d: every rank samples its own rollouts, gradients are
/// averaged across ranks before each optimizer step, the initial weights and buffers are
/// broadcast from rank 0 (and the trainer broadcasts rank 0's buffers again after every weight
/// sync), and the stability guard skips a step on every rank when any rank sees a NaN.
///
/// ```cpp
/// // torchrun-style environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
/// auto dp = unirl::parallel::data_parallel<unirl::parallel::gloo>::from_environment();
/// unirl::trainer<my_model, my_algo, my_reward, unirl::parallel::data_parallel<unirl::parallel::gloo>>
///     t{model, reward, opts, std::move(dp)};
/// ```
/// Backends: `parallel::gloo` (CPU tensors; Gloo ships with LibTorch), `parallel::nccl` (CUDA
/// tensors) and `parallel::gloo_nccl` (one group: NCCL for CUDA tensors, Gloo for CPU tensors,
/// each collective by its tensors' device); the last two when unirl is configured with
/// `-DUNIRL_ENABLE_NCCL=ON` (a LibTorch built with NCCL; `UNIRL_WITH_NCCL` defined). The step
/// statistics are averaged over ranks (`all_reduce_mean`), the reward range taken over all of
/// them (`all_reduce_max`). `unirl::par` is the former name of the namespace, kept as an alias.
///
/// Gradient compression: `data_parallel_options{.compression = gradient_compression::powersgd,
/// .powersgd = {.rank = 2, .start_iter = 10}}` as the third argument (or the second of
/// `from_environment`) averages the gradients with PowerSGD and error feedback
/// (parallel/powersgd.hpp). Sharded optimizer state (ZeRO-1 / ZeRO-2): parallel/zero.hpp.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(UNIRL_WITH_NCCL)
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <unirl/concepts/parallel.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/core/options.hpp>
#include <unirl/parallel/powersgd.hpp>

namespace unirl::parallel {

/// How the ranks find each other: a shared file (`file_path`, one machine or a shared file
/// system) or a TCP store served by rank 0 (`host`, `port`).
struct rendezvous {
  std::string file_path{};           // FileStore when set
  std::string host = "127.0.0.1";    // TCPStore otherwise
  int port = 29500;
  std::string interface_host{};      // Gloo: address to bind (empty: the machine's hostname)
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::int64_t broadcast_every = 0;  // > 0: re-broadcast rank 0's weights every N syncs
};

/// How a `data_parallel` strategy averages gradients.
struct data_parallel_options {
  gradient_compression compression = gradient_compression::none;  // none | powersgd
  powersgd_options powersgd{};                                    // used with compression = powersgd

  void validate(const std::string& prefix) const { powersgd.validate(prefix + "powersgd."); }
};

/// torchrun's variables for a process of `who` (e.g. "data_parallel"): MASTER_ADDR and
/// MASTER_PORT into `r` (kept when unset); returns {RANK, WORLD_SIZE} ({0, 1} when unset). A
/// value that is not a whole integer is an error naming `who`, the variable and its text.
inline std::pair<int, int> read_launch_environment(const char* who, rendezvous& r) {
  auto parse = [who](const char* name, const std::string& fallback) {
    const char* v = std::getenv(name);
    const std::string text = v ? v : fallback;
    try {
      std::size_t used = 0;
      const int x = std::stoi(text, &used);
      if (used == text.size()) return x;
    } catch (const std::exception&) {
    }
    throw ::unirl::error(
        ::unirl::detail::concat("unirl: ", who, ": environment variable ", name, " = '", text, "' is not an integer"));
  };
  if (const char* a = std::getenv("MASTER_ADDR")) r.host = a;
  r.port = parse("MASTER_PORT", std::to_string(r.port));
  return {parse("RANK", "0"), parse("WORLD_SIZE", "1")};
}

/// LibTorch 2.4 and later ask for TCPStore's libuv backend by default, and a LibTorch built without
/// libuv (Debian's 2.6) then refuses to make the store: every TCPStore here uses the classic
/// backend, which LibTorch 1.13 has alone and which speaks the same protocol to either server.
template <class Options>
void use_classic_tcpstore(Options& o) {
  if constexpr (requires { o.useLibUV; }) o.useLibUV = false;
}

/// The store the ranks of `r` meet at: a FileStore at `r.file_path`, or a TCPStore at `r.host`,
/// `r.port` served by rank 0 (every wait bounded by `r.timeout`).
inline c10::intrusive_ptr<c10d::Store> make_store(const rendezvous& r, int rank, int world_size) {
  if (!r.file_path.empty()) return c10::make_intrusive<c10d::FileStore>(r.file_path, world_size);
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(r.port);
  o.isServer = rank == 0;
  o.numWorkers = world_size;
  o.timeout = r.timeout;
  use_classic_tcpstore(o);
  return c10::make_intrusive<c10d::TCPStore>(r.host, o);
}

/// Gloo process groups (CPU tensors).
struct gloo {
  static c10::intrusive_ptr<c10d::ProcessGroupGloo> create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                           int world_size, const rendezvous& r) {
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->timeout = r.timeout;
    opts->devices.push_back(r.interface_host.empty()
                                ? c10d::ProcessGroupGloo::createDefaultDevice()
                                : c10d::ProcessGroupGloo::createDeviceForHostname(r.interface_host));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, opts);
  }
};

#if defined(UNIRL_WITH_NCCL)
/// NCCL process groups (CUDA tensors).
struct nccl {
  static c10::intrusive_ptr<c10d::ProcessGroupNCCL> create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                           int world_size, const rendezvous& r) {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = r.timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, opts);
  }
};

/// One process group over both: NCCL for CUDA tensors, Gloo for CPU tensors. Each collective goes
/// to the backend of its tensors' device (c10d's per-device backends), so a strategy over it
/// reduces a model on the GPU through NCCL and host buffers (statistics, the transport's) through
/// Gloo. Where no GPU is visible the group is Gloo alone.
struct gloo_nccl {
  static c10::intrusive_ptr<c10d::ProcessGroup> create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                       int world_size, const rendezvous& r) {
    auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world_size);
    // Each backend meets its peers under its own prefix of the store.
    const c10::intrusive_ptr<c10d::Backend> host =
        gloo::create(c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, world_size, r);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, host);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    if (torch::cuda::is_available()) {
      const c10::intrusive_ptr<c10d::Backend> device =
          nccl::create(c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, world_size, r);
      group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, device);
    }
    return group;
  }
};
#endif

/// The `ParallelStrategy` for data parallelism over a c10d backend.
template <class Backend = gloo>
class data_parallel {
  static_assert(requires(const c10::intrusive_ptr<c10d::Store>& s, const rendezvous& r) { Backend::create(s, 0, 1, r); },
                "unirl::parallel::data_parallel: Backend must provide static create(store, rank, world_size, rendezvous)");

 public:
  data_parallel(int rank, int world_size, rendezvous r = {}, data_parallel_options o = {})
      : rank_(rank), world_size_(world_size), r_(std::move(r)), o_(std::move(o)) {
    UNIRL_CHECK(world_size >= 1, "data_parallel: world_size = ", world_size, ": expected >= 1");
    UNIRL_CHECK(rank >= 0 && rank < world_size, "data_parallel: rank = ", rank, ": expected in [0, ", world_size, ")");
    o_.validate("data_parallel.");
    if (o_.compression == gradient_compression::powersgd) compressor_.emplace(o_.powersgd);
    const c10::intrusive_ptr<c10d::Store> store = make_store(r_, rank, world_size);
    group_ = Backend::create(store, rank, world_size, r_);
  }

  /// A group on a store opened elsewhere — e.g. the learners of a `deployment` with several
  /// learner ranks, on the deployment's store under a `c10d::PrefixStore` of their own. `rank`
  /// and `world_size` are this group's; `r`'s host, port and file are not used (its timeout,
  /// Gloo interface and `broadcast_every` are).
  data_parallel(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, rendezvous r = {},
                data_parallel_options o = {})
      : rank_(rank), world_size_(world_size), r_(std::move(r)), o_(std::move(o)) {
    UNIRL_CHECK(store, "data_parallel: store is null: expected an open c10d store");
    UNIRL_CHECK(world_size >= 1, "data_parallel: world_size = ", world_size, ": expected >= 1");
    UNIRL_CHECK(rank >= 0 && rank < world_size, "data_parallel: rank = ", rank, ": expected in [0, ", world_size, ")");
    o_.validate("data_parallel.");
    if (o_.compression == gradient_compression::powersgd) compressor_.emplace(o_.powersgd);
    group_ = Backend::create(store, rank, world_size, r_);
  }

  /// Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the variables torchrun sets).
  static data_parallel from_environment(rendezvous r = {}, data_parallel_options o = {}) {
    const auto [rank, world] = read_launch_environment("data_parallel", r);
    return data_parallel(rank, world, std::move(r), std::move(o));
  }

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  /// Averages `.grad()` over ranks: one flat buffer, one all-reduce. A parameter without a
  /// gradient contributes zeros (every rank must hold the same parameter list). With
  /// `compression = powersgd` (from its `start_iter`-th call on): PowerSGD's approximate mean.
  void all_reduce_gradients(const std::vector<torch::Tensor>& params) {
    if (world_size_ == 1 || params.empty()) return;
    if (compressor_) {
      compressor_->reduce(params, world_size_, [this](torch::Tensor& flat) {
        std::vector<torch::Tensor> t{flat};
        group_->allreduce(t)->wait();
      });
      return;
    }
    std::vector<torch::Tensor> grads;
    grads.reserve(params.size());
    for (const auto& p : params)
      grads.push_back(p.grad().defined() ? p.grad().reshape({-1}) : torch::zeros({p.numel()}, p.options()));
    std::vector<torch::Tensor> flat{torch::cat(grads)};
    group_->allreduce(flat)->wait();
    flat[0].div_(world_size_);
    std::int64_t offset = 0;
    torch::NoGradGuard no_grad;
    for (const auto& p : params) {
      auto slice = flat[0].slice(0, offset, offset + p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(slice);
      else p.mutable_grad() = slice.clone();
      offset += p.numel();
    }
  }

  /// Copies rank `root`'s values into `tensors` on every rank: one flat broadcast per dtype and
  /// device, so mixed lists (float parameters, int64 or bool buffers such as BatchNorm's
  /// `num_batches_tracked`) travel exactly.
  void broadcast(const std::vector<torch::Tensor>& tensors, int root) {
    if (world_size_ == 1 || tensors.empty()) return;
    torch::NoGradGuard no_grad;
    std::vector<bool> done(tensors.size(), false);
    for (std::size_t first = 0; first < tensors.size(); ++first) {
      if (done[first]) continue;
      const auto dtype = tensors[first].scalar_type();
      const auto dev = tensors[first].device();
      std::vector<std::size_t> bucket;
      for (std::size_t i = first; i < tensors.size(); ++i)
        if (!done[i] && tensors[i].scalar_type() == dtype && tensors[i].device() == dev) {
          bucket.push_back(i);
          done[i] = true;
        }
      std::vector<torch::Tensor> flats;
      for (auto i : bucket) flats.push_back(tensors[i].detach().reshape({-1}));
      auto joined = torch::cat(flats);
      if (dtype == torch::kBool) joined = joined.to(torch::kUInt8);  // bool travels as uint8
      std::vector<torch::Tensor> flat{joined};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      group_->broadcast(flat, o)->wait();
      std::int64_t offset = 0;
      for (auto i : bucket) {
        const auto& t = tensors[i];
        t.detach().copy_(flat[0].slice(0, offset, offset + t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }

  /// The element-wise mean of `values` over ranks (every rank passes the same length).
  torch::Tensor all_reduce_mean(const torch::Tensor& values) {
    if (world_size_ == 1) return values;
    std::vector<torch::Tensor> t{values.detach().to(device(), torch::kFloat64).reshape({-1}).clone()};
    group_->allreduce(t)->wait();
    return (t[0] / world_size_).to(values.device());
  }
  /// The element-wise maximum of `values` over ranks.
  torch::Tensor all_reduce_max(const torch::Tensor& values) {
    if (world_size_ == 1) return values;
    std::vector<torch::Tensor> t{values.detach().to(device(), torch::kFloat64).reshape({-1}).clone()};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    group_->allreduce(t, o)->wait();
    return t[0].to(values.device());
  }
  /// The mean of `value` over ranks (one read).
  double all_reduce_mean(double value) {
    return to_host(all_reduce_mean(torch::tensor({value}, torch::kFloat64))).at(0);
  }

  /// True only when every rank passes `ok` (the guard skips a step everywhere or nowhere).
  bool all_agree(bool ok) {
    if (world_size_ == 1) return ok;
    std::vector<torch::Tensor> t{torch::tensor({ok ? 0.0 : 1.0}, torch::kFloat64).to(device())};
    group_->allreduce(t)->wait();
    return t[0].item<double>() == 0.0;
  }

  /// Ranks apply identical averaged updates, so weights stay equal; with `broadcast_every`
  /// rank 0's weights are re-broadcast every N syncs to remove any drift.
  void sync_weights(const std::vector<torch::Tensor>& params) {
    if (r_.broadcast_every > 0 && ++syncs_ % r_.broadcast_every == 0) broadcast(params, 0);
  }

  /// The L2 norm over all ranks of the gradients of `params` when each rank passes its own pieces
  /// (a sharding strategy's `grad_norm`): every rank's sum of squares, all-reduced on `device`, the
  /// norm returned there as a () tensor. A collective.
  torch::Tensor sharded_grad_norm(const std::vector<torch::Tensor>& params, torch::Device device) {
    torch::NoGradGuard no_grad;
    // Summed on `device` in float64: no host read per parameter (one would sync a CUDA stream).
    auto sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat64).device(device));
    for (const auto& p : params)
      if (p.defined() && p.grad().defined()) sq += p.grad().detach().norm().to(device, torch::kFloat64).pow(2);
    if (world_size_ > 1) {
      std::vector<torch::Tensor> t{sq};
      group_->allreduce(t)->wait();
      sq = t[0];
    }
    return sq.sqrt().reshape({});
  }

  /// Blocks until every rank arrives.
  void barrier() { group_->barrier()->wait(); }

  /// The options this strategy was made with.
  const data_parallel_options& settings() const { return o_; }
  /// The PowerSGD state (error feedback, warm-start factors); null without compression.
  const powersgd* compressor() const { return compressor_ ? &*compressor_ : nullptr; }
  /// The c10d process group (for strategies built on this one, e.g. `parallel::zero`).
  auto& process_group() { return *group_; }

 private:
  torch::Device device() const {
#if defined(UNIRL_WITH_NCCL)
    if constexpr (std::is_same_v<Backend, nccl>)
      return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank_ % std::max<int>(1, static_cast<int>(torch::cuda::device_count()))));
#endif
    return torch::kCPU;
  }

  int rank_ = 0;
  int world_size_ = 1;
  rendezvous r_;
  data_parallel_options o_{};
  std::optional<powersgd> compressor_{};
  std::int64_t syncs_ = 0;
  using group_ptr = decltype(Backend::create(std::declval<const c10::intrusive_ptr<c10d::Store>&>(), 0, 0,
                                            std::declval<const rendezvous&>()));
  group_ptr group_;
};

}  // namespace unirl::parallel

namespace unirl {
/// The former name of `unirl::parallel`, kept so that existing code compiles.
namespace par = parallel;
}  // namespace unirl

BOOST_HANA_ADAPT_STRUCT(unirl::parallel::data_parallel_options, compression, powersgd);

static_assert(unirl::ParallelStrategy<unirl::parallel::data_parallel<unirl::parallel::gloo>>);
