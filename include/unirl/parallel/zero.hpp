#pragma once
/// \file zero.hpp
/// Sharded optimizer state across data-parallel ranks (ZeRO stages 1 and 2, Rajbhandari et al.
/// 2020) over PyTorch's c10d: each rank keeps optimizer state (AdamW's two moments) only for
/// its own slice of the parameters and steps only that slice; the new values then reach every
/// rank through one all-gather.
///
/// ```cpp
/// // torchrun-style environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
/// using strategy = unirl::parallel::zero<unirl::parallel::gloo>;
/// unirl::trainer<my_model, my_algo, my_reward, strategy> t{model, reward, opts,
///     strategy::from_environment({}, {.stage = 2})};
/// ```
/// The partition: the trainable parameters (each tensor once, in the order the trainer lists
/// them) laid end to end as one flat vector of N elements; rank r owns the elements
/// [r N / W, (r + 1) N / W) — a contiguous, balanced (to one element) and deterministic slice
/// that may cut a tensor in two. `owned_parameters` hands the trainer one 1-D view per owned
/// piece (sharing the parameter's storage, under the parameter's own name, so the optimizer's
/// name-prefix groups still apply); the trainer builds its optimizer over those views only.
///
/// Stage 1: the gradients are averaged in full (one flat all-reduce, or PowerSGD when the
/// inner `data_parallel` compresses), each rank keeps its own slice of the average and frees the
/// gradients of the full parameters. Stage 2: each rank's slice of the gradient sum is reduced to
/// its owner only (one `reduce` per rank: Gloo in LibTorch 1.13 has no `reduce_scatter`), so no
/// rank ever holds the averaged gradient of slices it does not own; the local gradients of the
/// full parameters (which the backward pass produced) are freed right after. PowerSGD is not
/// combined with stage 2 (it needs the full average).
/// The gradient norm used for clipping and reported in the statistics is the global one: each
/// rank's sum of squares over its slice, all-reduced (`grad_norm`). Checkpoints: every rank
/// saves its own file (`trainer::save` on each rank, e.g. to `ckpt.rank<r>.pt`) holding the
/// full weights and its own optimizer shard; resume with the same world size.
#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/model.hpp>
#include <unirl/concepts/parallel.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/options.hpp>
#include <unirl/parallel/data_parallel.hpp>

namespace unirl::parallel {

/// ZeRO settings.
struct zero_options {
  std::int64_t stage = 1;  // 1: optimizer state sharded; 2: gradients reduced to their owner too

  void validate(const std::string& prefix) const {
    options::require(stage == 1 || stage == 2, prefix + "stage", stage, "1 or 2 (0: use data_parallel)");
  }
};

/// The `ParallelStrategy` for data parallelism with sharded optimizer state.
template <class Backend = gloo>
class zero {
 public:
  explicit zero(data_parallel<Backend> dp, zero_options o = {}) : dp_(std::move(dp)), o_(o) {
    o_.validate("zero.");
    UNIRL_CHECK(!(o_.stage == 2 && dp_.compressor()), "zero: stage = 2 with compression = powersgd: expected "
                "stage 1 for PowerSGD (it needs the full averaged gradient) or compression = none");
  }
  /// Reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the variables torchrun sets).
  static zero from_environment(rendezvous r = {}, zero_options z = {}, data_parallel_options o = {}) {
    return zero(data_parallel<Backend>::from_environment(std::move(r), std::move(o)), z);
  }

  int rank() const { return dp_.rank(); }
  int world_size() const { return dp_.world_size(); }
  const zero_options& settings() const { return o_; }
  data_parallel<Backend>& inner() { return dp_; }

  void broadcast(const std::vector<torch::Tensor>& tensors, int root) { dp_.broadcast(tensors, root); }
  torch::Tensor all_reduce_mean(const torch::Tensor& values) { return dp_.all_reduce_mean(values); }
  torch::Tensor all_reduce_max(const torch::Tensor& values) { return dp_.all_reduce_max(values); }
  double all_reduce_mean(double value) { return dp_.all_reduce_mean(value); }
  bool all_agree(bool ok) { return dp_.all_agree(ok); }
  void sync_weights(const std::vector<torch::Tensor>& params) { dp_.sync_weights(params); }
  void barrier() { dp_.barrier(); }

  /// This rank's pieces of the trainable tensors of `params` (each tensor counted once): 1-D
  /// views that share the parameters' storage, named as their parameter. Fixes the partition;
  /// call it once, before training, with the same list on every rank.
  named_tensors owned_parameters(const named_tensors& params) {
    layout_.clear();
    pieces_.clear();
    index_.clear();
    auto& seen = index_;
    total_ = 0;
    for (const auto& [name, p] : params) {
      UNIRL_CHECK(p.defined(), "zero: parameter '", name, "' is an undefined tensor");
      if (!p.requires_grad() || seen.count(p.unsafeGetTensorImpl())) continue;
      UNIRL_CHECK(p.is_contiguous(), "zero: parameter '", name, "' is not contiguous; expected contiguous parameters");
      if (!layout_.empty()) {
        const auto& first = layout_.front().param;
        UNIRL_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(), "zero: parameter '", name,
                    "' has dtype ", p.scalar_type(), " on ", p.device(), "; expected every trainable parameter in ",
                    first.scalar_type(), " on ", first.device());
      }
      seen.emplace(p.unsafeGetTensorImpl(), layout_.size());
      layout_.push_back({name, p, total_});
      total_ += p.numel();
    }
    const int w = world_size();
    UNIRL_CHECK(total_ >= w, "zero: ", total_, " trainable elements over ", w, " ranks: expected at least one per rank");
    bounds_.assign(static_cast<std::size_t>(w) + 1, 0);
    for (int r = 0; r <= w; ++r) bounds_[static_cast<std::size_t>(r)] = total_ * r / w;
    const std::int64_t lo = owned_begin(), hi = owned_end();
    named_tensors out;
    for (const auto& s : layout_) {
      const std::int64_t a = std::max(lo, s.offset), b = std::min(hi, s.offset + s.param.numel());
      if (a >= b) continue;
      auto view = s.param.detach().view({-1}).slice(0, a - s.offset, b - s.offset);
      view.requires_grad_(true);
      pieces_.push_back({view, a - lo});
      out.emplace_back(s.name, view);
    }
    return out;
  }

  /// The first and one-past-last flat element this rank owns, and the number of elements.
  std::int64_t owned_begin() const { return bounds_.empty() ? 0 : bounds_[static_cast<std::size_t>(rank())]; }
  std::int64_t owned_end() const { return bounds_.empty() ? 0 : bounds_[static_cast<std::size_t>(rank()) + 1]; }
  std::int64_t total_elements() const { return total_; }

  /// Averages the gradients of the parameters laid out by `owned_parameters` and leaves this
  /// rank's slice of the average in the `.grad()` of its pieces; the parameters' own gradients
  /// are freed (undefined). A parameter without a gradient contributes zeros. `params` must be
  /// (a list of) the parameters given to `owned_parameters`.
  void all_reduce_gradients(const std::vector<torch::Tensor>& params) {
    UNIRL_CHECK(!layout_.empty(), "zero: all_reduce_gradients before owned_parameters: expected the partition "
                "to be fixed first (the trainer calls owned_parameters when it builds its optimizer)");
    for (const auto& p : params)
      UNIRL_CHECK(!p.requires_grad() || index_of(p) >= 0, "zero: all_reduce_gradients got a parameter of shape ",
                  p.sizes(), " that owned_parameters did not see");
    torch::NoGradGuard no_grad;
    const int w = world_size();
    torch::Tensor owned;
    if (o_.stage == 1 && dp_.compressor()) {
      std::vector<torch::Tensor> all;
      for (const auto& s : layout_) all.push_back(s.param);
      dp_.all_reduce_gradients(all);  // PowerSGD: every .grad() is now the (approximate) mean
      owned = local_flat().slice(0, owned_begin(), owned_end()).clone();
    } else if (o_.stage == 1 || w == 1) {
      std::vector<torch::Tensor> flat{local_flat()};
      if (w > 1) dp_.process_group().allreduce(flat)->wait();
      owned = flat[0].slice(0, owned_begin(), owned_end()).clone().div_(w);
    } else {
      const auto flat = local_flat();
      for (int r = 0; r < w; ++r) {
        std::vector<torch::Tensor> seg{flat.slice(0, bounds_[static_cast<std::size_t>(r)],
                                                  bounds_[static_cast<std::size_t>(r) + 1]).clone()};
        c10d::ReduceOptions ro;
        ro.rootRank = r;
        dp_.process_group().reduce(seg, ro)->wait();
        if (r == rank()) owned = seg[0].div_(w);
      }
    }
    for (const auto& s : layout_) s.param.mutable_grad() = torch::Tensor();
    // Each piece its own gradient tensor (not a view: optimizers detach_() gradients in place).
    for (auto& pc : pieces_) pc.view.mutable_grad() = owned.slice(0, pc.offset, pc.offset + pc.view.numel()).clone();
  }

  /// The L2 norm over all ranks of the gradients of `params` (each rank passes its own pieces,
  /// e.g. the optimizer's parameters or one group of them): every rank's sum of squares,
  /// all-reduced. A collective: every rank calls it the same number of times.
  torch::Tensor grad_norm(const std::vector<torch::Tensor>& params) { return dp_.sharded_grad_norm(params, collective_device()); }


  /// After the optimizer stepped this rank's pieces: every rank receives every owner's new
  /// values (one all-gather of equal, padded chunks).
  void after_optimizer_step(const std::vector<torch::Tensor>& params) {
    (void)params;
    const int w = world_size();
    if (w == 1 || layout_.empty()) return;
    torch::NoGradGuard no_grad;
    std::int64_t chunk = 0;
    for (int r = 0; r < w; ++r)
      chunk = std::max(chunk, bounds_[static_cast<std::size_t>(r) + 1] - bounds_[static_cast<std::size_t>(r)]);
    const auto& first = layout_.front().param;
    auto mine = torch::zeros({chunk}, first.options().requires_grad(false));
    for (const auto& pc : pieces_) mine.slice(0, pc.offset, pc.offset + pc.view.numel()).copy_(pc.view.detach());
    std::vector<std::vector<torch::Tensor>> out(1);
    for (int r = 0; r < w; ++r) out[0].push_back(torch::empty_like(mine));
    std::vector<torch::Tensor> in{mine};
    dp_.process_group().allgather(out, in)->wait();
    for (int r = 0; r < w; ++r) {
      const std::int64_t a = bounds_[static_cast<std::size_t>(r)], b = bounds_[static_cast<std::size_t>(r) + 1];
      if (r == rank()) continue;  // this rank's pieces were stepped in place
      for (const auto& s : layout_) {
        const std::int64_t x = std::max(a, s.offset), y = std::min(b, s.offset + s.param.numel());
        if (x >= y) continue;
        s.param.detach().view({-1}).slice(0, x - s.offset, y - s.offset).copy_(out[0][static_cast<std::size_t>(r)].slice(0, x - a, y - a));
      }
    }
  }

 private:
  struct slot {
    std::string name;
    torch::Tensor param;
    std::int64_t offset = 0;  // in the flat vector
  };
  struct piece {
    torch::Tensor view;       // 1-D view of this rank's part of a parameter
    std::int64_t offset = 0;  // in this rank's slice
  };

  std::int64_t index_of(const torch::Tensor& p) const {
    const auto it = index_.find(p.unsafeGetTensorImpl());
    return it == index_.end() ? -1 : static_cast<std::int64_t>(it->second);
  }
  // Every parameter's local gradient (zeros where none) end to end.
  torch::Tensor local_flat() const {
    std::vector<torch::Tensor> gs;
    gs.reserve(layout_.size());
    for (const auto& s : layout_)
      gs.push_back(s.param.grad().defined() ? s.param.grad().detach().reshape({-1}) : torch::zeros({s.param.numel()}, s.param.options().requires_grad(false)));
    return torch::cat(gs);
  }
  torch::Device collective_device() const {
    return layout_.empty() ? torch::Device(torch::kCPU) : layout_.front().param.device();
  }

  data_parallel<Backend> dp_;
  zero_options o_;
  std::vector<slot> layout_{};
  std::vector<piece> pieces_{};
  std::unordered_map<const void*, std::size_t> index_{};  // parameter -> its slot in layout_
  std::vector<std::int64_t> bounds_{};
  std::int64_t total_ = 0;
};

}  // namespace unirl::parallel

BOOST_HANA_ADAPT_STRUCT(unirl::parallel::zero_options, stage);

static_assert(unirl::ParallelStrategy<unirl::parallel::zero<unirl::parallel::gloo>>);
static_assert(unirl::ShardedParallelStrategy<unirl::parallel::zero<unirl::parallel::gloo>>);
