#pragma once
/// \file fully_sharded.hpp
/// Fully sharded data parallelism (ZeRO stage 3, Rajbhandari et al. 2020; PyTorch's FSDP) over
/// c10d: the parameters, their gradients and AdamW's state are sharded over the ranks, and a
/// block's full parameters exist only around that block's forward and backward.
///
/// ```cpp
/// // torchrun-style environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
/// using strategy = unirl::parallel::fully_sharded<unirl::parallel::gloo>;
/// unirl::train::sft_trainer<unirl::models::hf::causal_lm, strategy> t(lm, opts, strategy::from_environment());
/// t.step(batch);                                         // this rank's part of the global batch
/// t.engine().parallel().save_sharded("ckpt", t.optim());  // ckpt/rank<r>.ckpt + ckpt/manifest.json
/// t.engine().parallel().with_full_weights([&] {          // every rank takes part in the gather
///   if (t.engine().parallel().rank() == 0) unirl::models::hf::save_pretrained(t.model(), "export");
/// });
/// ```
/// Layout: the model's blocks (`BlockStructuredModel::block_prefixes`, e.g. the decoder layers)
/// and the rest (embeddings, final norm, head) are *units*. A unit's trainable parameters lie end
/// to end in one flat buffer of n elements, padded to W equal chunks of c = ceil(n / W); rank r
/// keeps chunk r (`shard`) and steps it: the optimizer gets 1-D views of the shard, one per
/// parameter it overlaps, under the parameter's name (so name-prefix groups apply). The module's
/// parameters become views of the unit's flat buffer, whose storage is freed (resized to 0 bytes)
/// whenever the unit is not gathered; every view the autograd graph saved sees the values again
/// once the storage is refilled.
///
/// One update (`update_engine::step`, per micro-batch): `begin_forward` gathers the rest (kept for
/// the whole step); block l's hook gathers it before its forward (waiting for the gather started
/// one block earlier, `prefetch`) and starts block l + 1's (c10d's asynchronous work, so Gloo's
/// threads move block l + 1 while block l computes); after the forward the block is released. In
/// the backward, a gradient hook on block l's output fires before the block's backward: it
/// gathers block l again (under activation checkpointing the recomputation finds it gathered),
/// points its parameters' gradients into a flat gradient buffer, starts block l - 1's gather, and
/// reduce-scatters block l + 1's gradient buffer (one `reduce` per rank of its chunk: Gloo has no
/// `reduce_scatter` in LibTorch 1.13) and releases block l + 1. `all_reduce_gradients` finishes
/// block 0 and the rest. Each rank then holds only the mean gradient of its own chunk; clipping
/// uses the global norm (`grad_norm`). Frozen parameters (a LoRA base) are not sharded.
///
/// Memory (`peak_bytes`, the engine's `peak_model_state_bytes`): the shards, their gradients and
/// AdamW's moments (1/W of the unsharded run's each) plus what is live at one time: the rest's
/// parameters and gradient buffer, at most two blocks' parameters (the current one, the
/// prefetched one) and two blocks' gradient buffers (the current one, the previous one in its
/// reduce). Gloo's own staging buffers are not counted.
///
/// Checkpoints: `save_sharded(dir, optimizer)` writes `rank<r>.ckpt` on every rank (its chunks of
/// the values and of AdamW's moments, checksummed) and rank 0 writes `manifest.json` (world size,
/// units, each parameter's name, shape and offset); `load_sharded` reads a directory written by
/// any number of ranks into this layout (N -> M, e.g. 2 -> 1). `with_full_weights(f)` gathers
/// every unit into the model's parameters, runs `f` (a Hugging Face export on rank 0, a
/// `RolloutTransport::publish`) and releases them again; every rank must call it.
/// Limits: the parameters outside the engine's step are released, so forwards outside
/// `update_engine::step` (sampling, evaluation) run inside `with_full_weights`; the RL `trainer`,
/// which samples with the policy between updates, does not take this strategy yet.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/concepts/parallel.hpp>
#include <unirl/core/error.hpp>
#include <unirl/detail/compat.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/train/checkpoint.hpp>
#include <unirl/train/optimizer.hpp>

namespace unirl::parallel {

/// Fully sharded settings.
struct fully_sharded_options {
  bool prefetch = true;  // gather the next block while the current one computes (asynchronous c10d work)
};

namespace detail {

// Frees a tensor's storage (0 bytes) in place: every view of it stays, without data.
inline void free_storage(const torch::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}
// Gives a freed storage `bytes` bytes again (uninitialised), from its own allocator.
inline void allocate_storage(const torch::Tensor& t, std::size_t bytes) {
  auto* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == bytes) return;
  s->set_data_ptr(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

}  // namespace detail

/// The `FullyShardedParallelStrategy` (see the file comment). Copies share one state (the model's
/// hooks hold it too), so the engine may move it.
template <class Backend = gloo>
class fully_sharded {
  struct state;

 public:
  explicit fully_sharded(data_parallel<Backend> dp, fully_sharded_options o = {})
      : s_(std::make_shared<state>(std::move(dp), o)) {}
  /// Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the variables torchrun sets).
  static fully_sharded from_environment(rendezvous r = {}, fully_sharded_options o = {}) {
    return fully_sharded(data_parallel<Backend>::from_environment(std::move(r)), o);
  }

  int rank() const { return s_->dp.rank(); }
  int world_size() const { return s_->dp.world_size(); }
  const fully_sharded_options& settings() const { return s_->o; }
  data_parallel<Backend>& inner() { return s_->dp; }

  void broadcast(const std::vector<torch::Tensor>& tensors, int root) { s_->dp.broadcast(tensors, root); }
  torch::Tensor all_reduce_mean(const torch::Tensor& values) { return s_->dp.all_reduce_mean(values); }
  torch::Tensor all_reduce_max(const torch::Tensor& values) { return s_->dp.all_reduce_max(values); }
  double all_reduce_mean(double value) { return s_->dp.all_reduce_mean(value); }
  bool all_agree(bool ok) { return s_->dp.all_agree(ok); }
  void sync_weights(const std::vector<torch::Tensor>&) {}  // the weights live in the shards
  void barrier() { s_->dp.barrier(); }

  /// The hooks for a model whose blocks have parameter-name prefixes `prefixes` (in forward order).
  std::shared_ptr<block_hooks> attach_blocks(const std::vector<std::string>& prefixes) {
    UNIRL_CHECK(!prefixes.empty(), "fully_sharded: the model names no blocks: expected at least one block prefix");
    UNIRL_CHECK(s_->units.empty(), "fully_sharded: attach_blocks after owned_parameters: expected the blocks first");
    s_->prefixes = prefixes;
    return s_;
  }

  /// Lays out the units, keeps this rank's chunk of each and frees the rest: returns the 1-D views
  /// of the shards the optimizer steps (named as their parameters). Call once, with the same list
  /// on every rank, after `attach_blocks`.
  named_tensors owned_parameters(const named_tensors& params) { return s_->layout(params); }

  /// Before a forward of an update: finishes the previous micro-batch's gradients and gathers the
  /// parameters outside the blocks (kept until `all_reduce_gradients`).
  void begin_forward() { s_->begin_forward(); }

  /// After the backward: the remaining gradient reductions; this rank's chunk of the mean gradient
  /// is left in the `.grad()` of its views, the full gradients and parameters are freed.
  void all_reduce_gradients(const std::vector<torch::Tensor>&) { s_->finish_backward(); }

  /// The L2 norm over all ranks of the gradients of `params` (this rank's views): a collective.
  torch::Tensor grad_norm(const std::vector<torch::Tensor>& params) { return s_->dp.sharded_grad_norm(params, s_->device); }


  /// Nothing to bring back: the next forward gathers the stepped shards.
  void after_optimizer_step(const std::vector<torch::Tensor>&) {}

  /// Gathers every unit into the model's parameters, runs `f()`, releases them. A collective.
  template <class F>
  decltype(auto) with_full_weights(F&& f) {
    s_->gather_all();
    struct release {
      state* s;
      ~release() { s->release_all(); }
    } r{s_.get()};
    return std::forward<F>(f)();
  }

  /// The highest bytes of parameters and gradients this rank held (shards, their gradients,
  /// gathered units, gradient buffers), and the bytes now.
  std::int64_t peak_bytes() const { return s_->peak; }
  std::int64_t current_bytes() const { return s_->current(); }
  /// The bytes of one unit's full parameters: the largest block's, and the rest's.
  std::int64_t largest_block_bytes() const {
    std::int64_t b = 0;
    for (std::size_t u = 0; u + 1 < s_->units.size(); ++u) b = std::max(b, s_->units[u].padded() * s_->element_size);
    return b;
  }
  std::int64_t rest_bytes() const { return s_->units.empty() ? 0 : s_->units.back().padded() * s_->element_size; }

  /// Writes this rank's `rank<r>.ckpt` into `dir` (made if missing) and, on rank 0,
  /// `manifest.json`. Every rank calls it (a barrier at the end).
  void save_sharded(const std::string& dir, const train::optimizer& opt) { s_->save(dir, opt); }
  /// Reads a directory `save_sharded` wrote with any number of ranks into this rank's shards and
  /// `opt`'s state (built over `owned_parameters`). A manifest of another model throws
  /// `checkpoint_error` naming the parameter.
  void load_sharded(const std::string& dir, train::optimizer& opt) { s_->load(dir, opt); }

 private:
  struct slot {
    std::string name;
    torch::Tensor param;
    std::int64_t offset = 0, numel = 0;
  };
  struct piece {
    torch::Tensor view;       // 1-D leaf view of the shard (the optimizer's parameter)
    std::int64_t offset = 0;  // in the shard
  };
  struct unit {
    std::string prefix;  // a block's, "" for the rest
    std::vector<slot> slots;
    std::int64_t numel = 0, chunk = 0;
    torch::Tensor full;     // (chunk * W): the parameters are views of it; storage freed when not gathered
    torch::Tensor shard;    // (chunk): this rank's values
    std::vector<piece> pieces;
    torch::Tensor grads;    // (chunk * W) gradient buffer while this unit's backward runs
    bool gathered = false;
    c10::intrusive_ptr<c10d::Work> gathering;               // a gather in flight
    std::vector<std::vector<torch::Tensor>> gather_out{};
    std::vector<torch::Tensor> gather_in{};
    std::vector<c10::intrusive_ptr<c10d::Work>> reducing{};  // the reduces in flight
    std::int64_t padded() const { return chunk * static_cast<std::int64_t>(gather_world); }
    int gather_world = 1;
  };

  struct state : block_hooks, std::enable_shared_from_this<state> {
    state(data_parallel<Backend> d, fully_sharded_options opts) : dp(std::move(d)), o(opts) {}

    data_parallel<Backend> dp;
    fully_sharded_options o;
    std::vector<std::string> prefixes{};
    std::vector<unit> units{};  // the blocks in order, then the rest (possibly empty)
    torch::Device device = torch::kCPU;
    torch::ScalarType dtype = torch::kFloat;
    std::int64_t element_size = 4;
    std::int64_t peak = 0;
    bool backward = false;  // inside the backward (a recomputation must not prefetch forward)

    int W() const { return dp.world_size(); }
    int R() const { return dp.rank(); }
    std::size_t blocks() const { return units.empty() ? 0 : units.size() - 1; }

    std::int64_t current() const {
      std::int64_t b = 0;
      for (const auto& u : units) {
        b += static_cast<std::int64_t>(u.full.defined() ? u.full.storage().nbytes() : 0);
        b += u.shard.defined() ? u.shard.numel() * element_size : 0;
        b += u.grads.defined() ? u.grads.numel() * element_size : 0;
        for (const auto& pc : u.pieces)
          if (pc.view.grad().defined()) b += pc.view.grad().numel() * element_size;
      }
      return b;
    }
    void note() { peak = std::max(peak, current()); }

    named_tensors layout(const named_tensors& params) {
      UNIRL_CHECK(!prefixes.empty(), "fully_sharded: owned_parameters before attach_blocks: expected the model's "
                  "blocks first (update_engine::bind_model attaches them)");
      UNIRL_CHECK(units.empty(), "fully_sharded: owned_parameters called twice: expected one layout");
      units.assign(prefixes.size() + 1, unit{});
      for (std::size_t u = 0; u < prefixes.size(); ++u) units[u].prefix = prefixes[u];
      std::unordered_set<const void*> seen;
      bool first = true;
      for (const auto& [name, p] : params) {
        UNIRL_CHECK(p.defined(), "fully_sharded: parameter '", name, "' is an undefined tensor");
        if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
        UNIRL_CHECK(p.is_contiguous(), "fully_sharded: parameter '", name, "' is not contiguous; expected contiguous parameters");
        if (first) {
          device = p.device();
          dtype = p.scalar_type();
          element_size = static_cast<std::int64_t>(p.element_size());
          first = false;
        }
        UNIRL_CHECK(p.scalar_type() == dtype && p.device() == device, "fully_sharded: parameter '", name, "' has dtype ",
                    p.scalar_type(), " on ", p.device(), "; expected every trainable parameter in ", dtype, " on ", device);
        std::size_t u = prefixes.size();
        for (std::size_t b = 0; b < prefixes.size(); ++b)
          if (name.starts_with(prefixes[b])) {
            u = b;
            break;
          }
        units[u].slots.push_back({name, p, units[u].numel, p.numel()});
        units[u].numel += p.numel();
      }
      UNIRL_CHECK(!first, "fully_sharded: none of the ", params.size(), " parameters requires a gradient");
      for (std::size_t b = 0; b < prefixes.size(); ++b)
        UNIRL_CHECK(units[b].numel > 0, "fully_sharded: block '", prefixes[b], "' has no trainable parameter; expected ",
                    "every block prefix to name some");
      const auto opts = torch::TensorOptions(dtype).device(device);
      named_tensors out;
      torch::NoGradGuard no_grad;
      for (auto& u : units) {
        if (u.numel == 0) continue;
        u.gather_world = W();
        u.chunk = (u.numel + W() - 1) / W();
        u.full = torch::zeros({u.chunk * W()}, opts);
        for (const auto& s : u.slots) u.full.slice(0, s.offset, s.offset + s.numel).copy_(s.param.detach().reshape({-1}));
        u.shard = u.full.slice(0, R() * u.chunk, (R() + 1) * u.chunk).clone();
        for (const auto& s : u.slots) s.param.set_data(u.full.slice(0, s.offset, s.offset + s.numel).view(s.param.sizes()));
        const std::int64_t lo = R() * u.chunk, hi = std::min(u.numel, lo + u.chunk);
        for (const auto& s : u.slots) {
          const std::int64_t a = std::max(lo, s.offset), b = std::min(hi, s.offset + s.numel);
          if (a >= b) continue;
          auto view = u.shard.slice(0, a - lo, b - lo);
          view.requires_grad_(true);
          u.pieces.push_back({view, a - lo});
          out.emplace_back(s.name, view);
        }
        release(u);
      }
      note();
      return out;
    }

    // ---- gathering and releasing ----
    void start_gather(unit& u) {
      if (u.numel == 0 || u.gathered || u.gathering) return;
      detail::allocate_storage(u.full, static_cast<std::size_t>(u.padded() * element_size));
      note();
      torch::NoGradGuard no_grad;
      if (W() == 1) {
        u.full.copy_(u.shard);
        u.gathered = true;
        return;
      }
      u.gather_out.assign(1, {});
      for (int r = 0; r < W(); ++r) u.gather_out[0].push_back(u.full.slice(0, r * u.chunk, (r + 1) * u.chunk));
      u.gather_in = {u.shard};
      u.gathering = dp.process_group().allgather(u.gather_out, u.gather_in);
    }
    void ensure_gathered(unit& u) {
      if (u.numel == 0 || u.gathered) return;
      start_gather(u);
      if (u.gathering) {
        u.gathering->wait();
        u.gathering.reset();
        u.gather_out.clear();
        u.gather_in.clear();
      }
      u.gathered = true;
    }
    void release(unit& u) {
      if (u.numel == 0) return;
      ensure_gathered_or_idle(u);
      detail::free_storage(u.full);
      u.gathered = false;
    }
    // A gather in flight must land before its buffer goes.
    void ensure_gathered_or_idle(unit& u) {
      if (!u.gathering) return;
      u.gathering->wait();
      u.gathering.reset();
      u.gather_out.clear();
      u.gather_in.clear();
    }

    // ---- gradients ----
    // Points the unit's parameters' gradients into a zeroed flat buffer (AccumulateGrad adds there).
    void open_gradients(unit& u) {
      if (u.numel == 0 || u.grads.defined()) return;
      u.grads = torch::zeros({u.padded()}, torch::TensorOptions(dtype).device(device));
      for (const auto& s : u.slots) s.param.mutable_grad() = u.grads.slice(0, s.offset, s.offset + s.numel).view(s.param.sizes());
      note();
    }
    // Starts the reduce of every chunk of the unit's gradient buffer to its owner.
    void start_reduce(unit& u) {
      if (!u.grads.defined() || !u.reducing.empty()) return;
      for (const auto& s : u.slots) s.param.mutable_grad() = torch::Tensor();  // the buffer alone holds them now
      if (W() == 1) return;
      for (int r = 0; r < W(); ++r) {
        std::vector<torch::Tensor> seg{u.grads.slice(0, r * u.chunk, (r + 1) * u.chunk)};
        c10d::ReduceOptions ro;
        ro.rootRank = r;
        u.reducing.push_back(dp.process_group().reduce(seg, ro));
      }
    }
    // Waits for the reduces; adds this rank's chunk of the mean into its views' gradients.
    void finish_reduce(unit& u) {
      if (!u.grads.defined()) return;
      start_reduce(u);
      for (auto& w : u.reducing) w->wait();
      u.reducing.clear();
      torch::NoGradGuard no_grad;
      const auto mine = u.grads.slice(0, R() * u.chunk, (R() + 1) * u.chunk);
      if (W() > 1) mine.div_(W());
      for (auto& pc : u.pieces) {
        const auto g = mine.slice(0, pc.offset, pc.offset + pc.view.numel());
        if (pc.view.grad().defined()) pc.view.mutable_grad().add_(g);
        else pc.view.mutable_grad() = g.clone();  // its own tensor: optimizers detach_() gradients in place
      }
      note();
      u.grads = torch::Tensor();
    }

    // ---- the hooks ----
    void before_block(std::size_t l) override {
      UNIRL_CHECK(l < blocks(), "fully_sharded: the model ran block ", l, "; it named ", blocks(), " blocks");
      ensure_gathered(units[l]);
      note();
      if (!backward && o.prefetch && l + 1 < blocks()) start_gather(units[l + 1]);
    }
    torch::Tensor after_block(std::size_t l, const torch::Tensor& y) override {
      if (torch::GradMode::is_enabled() && y.requires_grad()) {
        std::weak_ptr<state> self = this->weak_from_this();
        y.register_hook([self, l](const torch::Tensor&) {
          if (auto s = self.lock()) s->before_block_backward(l);
        });
      }
      release(units[l]);
      return y;
    }
    // Block l's backward is next; block l + 1's has finished.
    void before_block_backward(std::size_t l) {
      backward = true;
      if (l + 2 < blocks()) finish_reduce(units[l + 2]);  // at most one block's reduce in flight
      if (l + 1 < blocks()) {
        start_reduce(units[l + 1]);
        release(units[l + 1]);
      }
      ensure_gathered(units[l]);
      open_gradients(units[l]);
      if (o.prefetch && l >= 1) start_gather(units[l - 1]);
      note();
    }
    // Everything still open from a backward: reduced and released (the rest too when `rest`).
    void flush(bool rest) {
      for (std::size_t b = 0; b < blocks(); ++b) {
        if (units[b].grads.defined()) finish_reduce(units[b]);
        if (units[b].gathered || units[b].gathering) release(units[b]);
      }
      if (rest) {
        finish_reduce(units.back());
        release(units.back());
      }
    }
    void begin_forward() {
      UNIRL_CHECK(!units.empty(), "fully_sharded: a forward before owned_parameters: expected the engine to be bound");
      flush(false);
      backward = false;
      ensure_gathered(units.back());
      open_gradients(units.back());
      note();
    }
    void finish_backward() {
      UNIRL_CHECK(!units.empty(), "fully_sharded: all_reduce_gradients before owned_parameters");
      flush(true);
      backward = false;
      note();
    }
    void gather_all() {
      for (auto& u : units) start_gather(u);
      for (auto& u : units) ensure_gathered(u);
      note();
    }
    void release_all() {
      for (auto& u : units) release(u);
    }

    // ---- checkpoints ----
    nlohmann::json manifest() const {
      nlohmann::json us = nlohmann::json::array();
      for (const auto& u : units) {
        nlohmann::json ps = nlohmann::json::array();
        for (const auto& s : u.slots)
          ps.push_back({{"name", s.name}, {"shape", s.param.sizes().vec()}, {"offset", s.offset}});
        us.push_back({{"prefix", u.prefix}, {"numel", u.numel}, {"chunk", u.chunk}, {"params", ps}});
      }
      return {{"format", "unirl.fully_sharded"}, {"version", 1}, {"world_size", W()}, {"units", us}};
    }
    // AdamW's moments of a unit's shard (chunk elements, zeros where none) and its step count (-1: none).
    std::tuple<torch::Tensor, torch::Tensor, std::int64_t> moments(const unit& u, const train::optimizer& opt) const {
      auto m1 = torch::zeros({u.chunk}, torch::TensorOptions(dtype).device(device));
      auto m2 = torch::zeros_like(m1);
      std::int64_t step = -1;
      const auto& st = const_cast<train::optimizer&>(opt).torch_optimizer().state();
      for (const auto& pc : u.pieces) {
        const auto it = st.find(::unirl::detail::compat::optimizer_state_key_of(pc.view));
        if (it == st.end()) continue;
        const auto& a = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        m1.slice(0, pc.offset, pc.offset + pc.view.numel()).copy_(a.exp_avg().reshape({-1}));
        m2.slice(0, pc.offset, pc.offset + pc.view.numel()).copy_(a.exp_avg_sq().reshape({-1}));
        step = a.step();
      }
      return {m1, m2, step};
    }
    void save(const std::string& dir, const train::optimizer& opt) {
      std::filesystem::create_directories(dir);
      const auto path = (std::filesystem::path(dir) / ("rank" + std::to_string(R()) + ".ckpt")).string();
      train::write_checkpoint(path, [&](torch::serialize::OutputArchive& a) {
        a.write("rank", torch::tensor(static_cast<std::int64_t>(R())));
        a.write("world_size", torch::tensor(static_cast<std::int64_t>(W())));
        for (std::size_t i = 0; i < units.size(); ++i) {
          const auto& u = units[i];
          if (u.numel == 0) continue;
          const auto [m1, m2, step] = moments(u, opt);
          const auto k = "u" + std::to_string(i) + "/";
          a.write(k + "values", u.shard.detach().cpu());
          a.write(k + "exp_avg", m1.cpu());
          a.write(k + "exp_avg_sq", m2.cpu());
          a.write(k + "step", torch::tensor(step));
        }
      });
      if (R() == 0) {
        const auto m = std::filesystem::path(dir) / "manifest.json";
        const auto tmp = m.string() + ".tmp";
        {
          std::ofstream f(tmp);
          f << manifest().dump(1) << "\n";
          UNIRL_CHECK(f.good(), "fully_sharded::save_sharded: cannot write '", tmp, "'");
        }
        std::filesystem::rename(tmp, m);
      }
      dp.barrier();
    }
    void load(const std::string& dir, train::optimizer& opt) {
      const auto mpath = std::filesystem::path(dir) / "manifest.json";
      std::ifstream f(mpath);
      if (!f) throw checkpoint_error("fully_sharded::load_sharded: no manifest '" + mpath.string() + "'");
      nlohmann::json m;
      try {
        f >> m;
      } catch (const std::exception& e) {
        throw checkpoint_error("fully_sharded::load_sharded: '" + mpath.string() + "' is not JSON: " + e.what());
      }
      if (m.value("format", std::string()) != "unirl.fully_sharded" || !m.contains("world_size") || !m.contains("units"))
        throw checkpoint_error("fully_sharded::load_sharded: '" + mpath.string() +
                               "' is not a fully_sharded manifest (format, world_size, units)");
      const auto old_world = m["world_size"].get<std::int64_t>();
      const auto& us = m["units"];
      if (old_world < 1 || us.size() != units.size())
        throw checkpoint_error(::unirl::detail::concat("fully_sharded::load_sharded: the manifest has ", us.size(),
                                                       " units over ", old_world, " ranks; this model has ",
                                                       units.size(), " units"));
      std::vector<std::int64_t> old_chunk(units.size());
      for (std::size_t i = 0; i < units.size(); ++i) {
        const auto& u = units[i];
        const auto& j = us[i];
        if (j["numel"].get<std::int64_t>() != u.numel || j["params"].size() != u.slots.size())
          throw checkpoint_error(::unirl::detail::concat("fully_sharded::load_sharded: unit ", i, " ('", u.prefix,
                                                         "') has ", j["numel"].get<std::int64_t>(),
                                                         " elements in the checkpoint, ", u.numel, " here"));
        for (std::size_t p = 0; p < u.slots.size(); ++p) {
          const auto& jp = j["params"][p];
          if (jp["name"].get<std::string>() != u.slots[p].name ||
              jp["shape"].get<std::vector<std::int64_t>>() != u.slots[p].param.sizes().vec() ||
              jp["offset"].get<std::int64_t>() != u.slots[p].offset)
            throw checkpoint_error("fully_sharded::load_sharded: parameter '" + jp["name"].get<std::string>() +
                                   "' of the checkpoint does not match '" + u.slots[p].name + "' here (name, shape, offset)");
        }
        old_chunk[i] = j["chunk"].get<std::int64_t>();
      }
      // This rank's new chunk of values and moments, filled from every old rank's file in turn.
      std::vector<torch::Tensor> v(units.size()), m1(units.size()), m2(units.size());
      std::vector<std::int64_t> step(units.size(), -1);
      for (std::size_t i = 0; i < units.size(); ++i) {
        if (units[i].numel == 0) continue;
        v[i] = torch::zeros({units[i].chunk}, torch::TensorOptions(dtype).device(device));
        m1[i] = torch::zeros_like(v[i]);
        m2[i] = torch::zeros_like(v[i]);
      }
      for (std::int64_t r = 0; r < old_world; ++r) {
        const auto path = (std::filesystem::path(dir) / ("rank" + std::to_string(r) + ".ckpt")).string();
        train::read_checkpoint(path, [&](torch::serialize::InputArchive& a) {
          for (std::size_t i = 0; i < units.size(); ++i) {
            const auto& u = units[i];
            if (u.numel == 0) continue;
            const std::int64_t olo = r * old_chunk[i], ohi = std::min(u.numel, olo + old_chunk[i]);
            const std::int64_t lo = R() * u.chunk, hi = std::min(u.numel, lo + u.chunk);
            const std::int64_t a0 = std::max(lo, olo), a1 = std::min(hi, ohi);
            const auto k = "u" + std::to_string(i) + "/";
            torch::Tensor val, e1, e2, st;
            a.read(k + "step", st);
            step[i] = std::max(step[i], st.item<std::int64_t>());  // every rank's pieces stepped together
            if (a0 >= a1) continue;
            a.read(k + "values", val);
            a.read(k + "exp_avg", e1);
            a.read(k + "exp_avg_sq", e2);
            if (val.numel() != old_chunk[i])
              throw checkpoint_error(::unirl::detail::concat("fully_sharded::load_sharded: '", path, "' holds ",
                                                             val.numel(), " values of unit ", i, "; expected ", old_chunk[i]));
            v[i].slice(0, a0 - lo, a1 - lo).copy_(val.slice(0, a0 - olo, a1 - olo));
            m1[i].slice(0, a0 - lo, a1 - lo).copy_(e1.slice(0, a0 - olo, a1 - olo));
            m2[i].slice(0, a0 - lo, a1 - lo).copy_(e2.slice(0, a0 - olo, a1 - olo));
          }
        });
      }
      torch::NoGradGuard no_grad;
      auto& st = opt.torch_optimizer().state();
      for (std::size_t i = 0; i < units.size(); ++i) {
        auto& u = units[i];
        if (u.numel == 0) continue;
        u.shard.copy_(v[i]);
        for (const auto& pc : u.pieces) {
          const auto key = ::unirl::detail::compat::optimizer_state_key_of(pc.view);
          if (step[i] < 0) {
            st.erase(key);
            continue;
          }
          auto s = std::make_unique<torch::optim::AdamWParamState>();
          s->step(step[i]);
          s->exp_avg(m1[i].slice(0, pc.offset, pc.offset + pc.view.numel()).clone());
          s->exp_avg_sq(m2[i].slice(0, pc.offset, pc.offset + pc.view.numel()).clone());
          st[key] = std::move(s);
        }
      }
    }
  };

  std::shared_ptr<state> s_;
};

}  // namespace unirl::parallel

BOOST_HANA_ADAPT_STRUCT(unirl::parallel::fully_sharded_options, prefetch);

static_assert(unirl::FullyShardedParallelStrategy<unirl::parallel::fully_sharded<unirl::parallel::gloo>>);
