#pragma once
/// \file parallel.hpp
/// Parallelism strategies: how gradients are reduced and how rollout weights are synced, and
/// `parallel::single_device`, the identity strategy every trainer and `train::update_engine`
/// defaults to (here, with the concept, so that the layers below `parallel/` can name it).
#include <concepts>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/model.hpp>

namespace unirl {

/// A parallelism strategy.
///
/// Minimal complete definition:
/// - `int rank() const`, `int world_size() const`;
/// - `void all_reduce_gradients(const std::vector<torch::Tensor>& params)` — averages `.grad()`;
/// - `void broadcast(const std::vector<torch::Tensor>& tensors, int root)` — in place;
/// - `torch::Tensor all_reduce_mean(const torch::Tensor& values)` — the element-wise mean over
///   ranks of a 1-D float64 tensor (every rank passes the same length): the trainer reduces its
///   step statistics through it, once per step;
/// - `bool all_agree(bool ok)` — true only if every rank says true (the stability guard);
/// - `void sync_weights(const std::vector<torch::Tensor>& params)` — called with the policy's
///   parameters after every step's update (every strategy here does nothing: the ranks hold equal
///   weights after the averaged update; the learner → sampler sync of the split mode is
///   `RolloutTransport::publish`, concepts/transport.hpp).
/// Optional: `torch::Tensor all_reduce_max(const torch::Tensor& values)` (element-wise maximum;
/// the trainer then reports the reward range over all ranks, else rank 0's own).
/// Optional, all three together (`ShardedParallelStrategy`: the optimizer state is sharded over
/// the ranks, as `parallel::zero` does):
/// - `named_tensors owned_parameters(const named_tensors& params)` — the tensors this rank's
///   optimizer steps (pieces of `params`, e.g. 1-D views into their storage, under the
///   parameters' names); the trainer calls it once and builds its optimizer over them;
/// - `torch::Tensor grad_norm(const std::vector<torch::Tensor>& params)` — the global L2 norm of
///   the gradients of `params` when each rank passes its own pieces (a collective: the trainer
///   calls it for the clipping norm and for every group with its own `max_grad_norm`, the same
///   number of times on every rank); after `all_reduce_gradients` only the pieces hold gradients;
/// - `void after_optimizer_step(const std::vector<torch::Tensor>& params)` — after the optimizer
///   stepped the pieces: brings every rank the owners' new values of `params`.
/// Optional on top (`FullyShardedParallelStrategy`: the parameters are sharded too, ZeRO-3, as
/// `parallel::fully_sharded` does): `attach_blocks(prefixes)` and `begin_forward()` (below).
template <class P>
concept ParallelStrategy = requires(P& p, const P& cp, const std::vector<torch::Tensor>& ts, const torch::Tensor& v,
                                    bool b) {
  { cp.rank() } -> std::convertible_to<int>;
  { cp.world_size() } -> std::convertible_to<int>;
  p.all_reduce_gradients(ts);
  p.broadcast(ts, 0);
  { p.all_reduce_mean(v) } -> std::same_as<torch::Tensor>;
  { p.all_agree(b) } -> std::convertible_to<bool>;
  p.sync_weights(ts);
};

/// A `ParallelStrategy` that shards the optimizer state (see the optional members above).
template <class P>
concept ShardedParallelStrategy = ParallelStrategy<P> && requires(P& p, const named_tensors& named,
                                                                  const std::vector<torch::Tensor>& ts) {
  { p.owned_parameters(named) } -> std::convertible_to<named_tensors>;
  { p.grad_norm(ts) } -> std::same_as<torch::Tensor>;
  p.after_optimizer_step(ts);
};

/// Code a model runs around each of its blocks (the decoder layers of a language model), so that a
/// policy that keeps only a slice of every parameter (`parallel::fully_sharded`, ZeRO-3) can
/// gather a block's parameters just before its forward and release them after it.
///
/// ```cpp
/// for (std::size_t l = 0; l < layers.size(); ++l) {   // in a model's forward
///   if (hooks) hooks->before_block(l);
///   x = layers[l]->forward(x);
///   if (hooks) x = hooks->after_block(l, x);
/// }
/// ```
/// `before_block(l)` runs before block l's forward, and again inside its recomputation when the
/// block is activation-checkpointed; `after_block(l, y)` gets the block's output and returns the
/// tensor the rest of the model reads (`y` itself, with a gradient hook on it under autograd).
struct block_hooks {
  virtual ~block_hooks() = default;
  virtual void before_block(std::size_t block) = 0;
  virtual torch::Tensor after_block(std::size_t block, const torch::Tensor& output) = 0;
};

/// A model made of blocks run in order (`models::hf::causal_lm`): `block_prefixes()` names each
/// block's parameters by prefix (`model.layers.3.`), `set_block_hooks(h)` makes its forwards call
/// `h` around each block (null: no hooks).
template <class M>
concept BlockStructuredModel = requires(M& m, const M& cm, std::shared_ptr<block_hooks> h) {
  m.set_block_hooks(h);
  { cm.block_prefixes() } -> std::convertible_to<std::vector<std::string>>;
};

/// A `ShardedParallelStrategy` that shards the parameters as well (ZeRO-3 / FSDP):
/// - `std::shared_ptr<block_hooks> attach_blocks(const std::vector<std::string>& prefixes)` — the
///   hooks to give a `BlockStructuredModel` whose blocks have these prefixes; called before
///   `owned_parameters`, which then lays out one flat shard per block (and one for the rest);
/// - `void begin_forward()` — before each forward of an update (every micro-batch): the
///   parameters outside the blocks are gathered there; the blocks' by the hooks.
/// `update_engine::bind_model(model, who)` wires both.
template <class P>
concept FullyShardedParallelStrategy =
    ShardedParallelStrategy<P> && requires(P& p, const std::vector<std::string>& prefixes) {
      { p.attach_blocks(prefixes) } -> std::convertible_to<std::shared_ptr<block_hooks>>;
      p.begin_forward();
    };

}  // namespace unirl

namespace unirl::parallel {

/// The default parallelism: one process, one device; nothing to reduce, nothing to sync.
struct single_device {
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_reduce_gradients(const std::vector<torch::Tensor>&) {}
  void broadcast(const std::vector<torch::Tensor>&, int) {}
  torch::Tensor all_reduce_mean(const torch::Tensor& v) { return v; }
  torch::Tensor all_reduce_max(const torch::Tensor& v) { return v; }
  double all_reduce_mean(double v) { return v; }
  bool all_agree(bool ok) { return ok; }
  void sync_weights(const std::vector<torch::Tensor>&) {}
};
static_assert(ParallelStrategy<single_device>);

}  // namespace unirl::parallel
