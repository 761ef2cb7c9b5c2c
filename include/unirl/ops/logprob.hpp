#pragma once
/// \file logprob.hpp
/// Token log-probabilities and entropies from logits — the hottest op of LM training.
///
/// ```cpp
/// auto [logp, entropy] = unirl::ops::token_logprob<unirl::exec::automatic>(logits, targets);
/// // logits (N, V) float, targets (N,) int64  ->  logp (N,), entropy (N,), both differentiable
/// auto lp = unirl::ops::linear_logprob(hidden, lm_head_weight, targets, /*chunk=*/1024);
/// // the (N, V) logits are never held in memory at once, forward or backward
/// ```
/// `exec::reference` composes LibTorch ops (log_softmax, gather, a product for the entropy) and
/// materialises the (N, V) log-probabilities and their gradient; `exec::cpu` is one fused pass
/// per row (max, log-sum-exp, target logit, entropy) and a fused backward, with nothing of size
/// (N, V) kept between them but the logits themselves.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <unirl/concepts/execution.hpp>
#include <unirl/config.hpp>
#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>
#include <unirl/exec/policy.hpp>

#if defined(UNIRL_WITH_CUDA_KERNELS)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <unirl/ops/cuda/logprob.cuh>
#endif

namespace unirl::ops {

/// The floating type token log-probabilities are computed in for logits of type `t`: float64
/// stays float64, every other type (float32; float16 and bfloat16, upcast for accuracy) float32.
inline torch::ScalarType logprob_dtype(torch::ScalarType t) {
  return t == torch::kDouble ? torch::kDouble : torch::kFloat;
}

/// Log-probabilities of the targets and the entropies of the rows.
struct logprob_result {
  torch::Tensor logp;     // (N,)
  torch::Tensor entropy;  // (N,)
};

namespace detail {

// Checks that every target indexes the vocabulary [0, v). Inside a `deferred_checks` scope (the
// trainer's step) the check is recorded there and read with the step's next read, and the
// returned targets are clamped into the vocabulary so that nothing reads out of bounds meanwhile;
// outside one it reads the range at once (one host synchronisation) and throws.
inline torch::Tensor check_vocabulary(const torch::Tensor& targets, std::int64_t v, const char* who) {
  if (targets.numel() == 0) return targets;
  const auto range = torch::stack({targets.min(), targets.max()});
  auto message = [who, v](const std::vector<double>& r) {
    return ::unirl::detail::concat(who, ": targets range over [", static_cast<std::int64_t>(r.at(0)), ", ",
                                   static_cast<std::int64_t>(r.at(1)), "], outside the vocabulary [0, ", v, ")");
  };
  if (auto* deferred = deferred_checks::current()) {
    deferred->add((range.select(0, 0) >= 0) & (range.select(0, 1) < v), range, message);
    return targets.clamp(0, v - 1);
  }
  const auto r = to_host(range);
  if (!(r.at(0) >= 0 && r.at(1) < static_cast<double>(v))) throw ::unirl::error("unirl: " + message(r));
  return targets;
}

// What a log-prob backward needs: the saved (logits, targets, lse, entropy) and the incoming
// gradients, zeros where a result was not used.
struct logprob_saved {
  torch::Tensor x, t, lse, ent, g_logp, g_ent;
};
inline logprob_saved unpack_saved(torch::autograd::AutogradContext* ctx, const torch::autograd::variable_list& grads) {
  const auto saved = ctx->get_saved_variables();
  const auto n = saved[0].size(0);
  auto grad_or_zeros = [&](const torch::Tensor& g) {
    return g.defined() ? g.contiguous() : torch::zeros({n}, saved[0].options());
  };
  return {saved[0], saved[1], saved[2], saved[3], grad_or_zeros(grads[0]), grad_or_zeros(grads[1])};
}

// Checks the shapes and the targets' range (see check_vocabulary); returns the targets to use.
inline torch::Tensor check_logprob_args(const torch::Tensor& logits, const torch::Tensor& targets) {
  UNIRL_CHECK(logits.dim() == 2, "token_logprob: logits must be (N, V), got shape ", logits.sizes());
  UNIRL_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0), "token_logprob: targets must be (",
              logits.size(0), ",), got shape ", targets.sizes());
  UNIRL_CHECK(targets.scalar_type() == torch::kLong, "token_logprob: targets must be int64, got ", targets.dtype());
  UNIRL_CHECK(logits.is_floating_point(), "token_logprob: logits must be floating point, got ", logits.dtype());
  return check_vocabulary(targets, logits.size(1), "token_logprob");
}

inline logprob_result logprob_reference(const torch::Tensor& logits, const torch::Tensor& targets) {
  const auto lsm = torch::log_softmax(logits, -1);
  return {lsm.gather(1, targets.unsqueeze(1)).squeeze(1), -(lsm.exp() * lsm).sum(-1)};
}

// Row statistics shared by the forward and the backward: log-sum-exp and entropy.
template <class T>
UNIRL_HOST_DEVICE inline void row_stats(const T* x, std::int64_t v, T& lse, T& entropy) {
  T m = x[0];
  for (std::int64_t j = 1; j < v; ++j) m = x[j] > m ? x[j] : m;
  T s = 0, sx = 0;
  for (std::int64_t j = 0; j < v; ++j) {
    const T e = std::exp(x[j] - m);
    s += e;
    sx += e * x[j];
  }
  lse = m + std::log(s);
  entropy = lse - sx / s;  // H = lse - E_p[x]
}

// Fused forward and backward on contiguous CPU rows.
struct fused_logprob : torch::autograd::Function<fused_logprob> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor logits,
                                                torch::Tensor targets) {
    const auto x = logits.contiguous();
    const auto t = targets.contiguous();
    const auto n = x.size(0), v = x.size(1);
    auto logp = torch::empty({n}, x.options());
    auto ent = torch::empty({n}, x.options());
    auto lse = torch::empty({n}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "unirl_fused_logprob", [&] {
      const auto* xp = x.data_ptr<scalar_t>();
      const auto* tp = t.data_ptr<std::int64_t>();
      auto* lp = logp.data_ptr<scalar_t>();
      auto* hp = ent.data_ptr<scalar_t>();
      auto* sp = lse.data_ptr<scalar_t>();
      at::parallel_for(0, n, 16, [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t i = lo; i < hi; ++i) {
          const auto* row = xp + i * v;
          row_stats(row, v, sp[i], hp[i]);
          lp[i] = row[tp[i]] - sp[i];
        }
      });
    });
    ctx->save_for_backward({x, t, lse, ent});
    return {logp, ent};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto [x, t, lse, ent, g_logp, g_ent] = unpack_saved(ctx, grads);
    const auto n = x.size(0), v = x.size(1);
    auto gx = torch::empty_like(x);
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "unirl_fused_logprob_backward", [&] {
      const auto* xp = x.data_ptr<scalar_t>();
      const auto* tp = t.data_ptr<std::int64_t>();
      const auto* sp = lse.data_ptr<scalar_t>();
      const auto* hp = ent.data_ptr<scalar_t>();
      const auto* gl = g_logp.data_ptr<scalar_t>();
      const auto* gh = g_ent.data_ptr<scalar_t>();
      auto* gp = gx.data_ptr<scalar_t>();
      at::parallel_for(0, n, 16, [&](std::int64_t lo, std::int64_t hi) {
        for (std::int64_t i = lo; i < hi; ++i) {
          const auto* row = xp + i * v;
          auto* out = gp + i * v;
          // d logp_t / dx_j = [j = t] - p_j ;  d H / dx_j = -p_j (log p_j + H)
          for (std::int64_t j = 0; j < v; ++j) {
            const scalar_t logp_j = row[j] - sp[i];
            const scalar_t p = std::exp(logp_j);
            out[j] = -gl[i] * p - gh[i] * p * (logp_j + hp[i]);
          }
          out[tp[i]] += gl[i];
        }
      });
    });
    return {gx, torch::Tensor()};
  }
};

#if defined(UNIRL_WITH_CUDA_KERNELS)
// The same op on CUDA tensors, through the kernels of ops/cuda/logprob.cuh.
struct cuda_logprob : torch::autograd::Function<cuda_logprob> {
  static void check(cudaError_t e) {
    UNIRL_CHECK(e == cudaSuccess, "token_logprob: CUDA kernel launch failed: ", cudaGetErrorString(e));
  }
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor logits,
                                                torch::Tensor targets) {
    const c10::cuda::CUDAGuard guard(logits.device());
    const auto x = logits.contiguous();
    const auto t = targets.contiguous();
    const auto n = x.size(0), v = x.size(1);
    auto logp = torch::empty({n}, x.options()), ent = torch::empty({n}, x.options()), lse = torch::empty({n}, x.options());
    const auto stream = at::cuda::getCurrentCUDAStream().stream();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "unirl_cuda_logprob", [&] {
      check(ops::cuda::logprob_forward<scalar_t>(x.data_ptr<scalar_t>(), t.data_ptr<std::int64_t>(), n, v,
                                                 logp.data_ptr<scalar_t>(), ent.data_ptr<scalar_t>(),
                                                 lse.data_ptr<scalar_t>(), stream));
    });
    ctx->save_for_backward({x, t, lse, ent});
    return {logp, ent};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto [x, t, lse, ent, gl, gh] = unpack_saved(ctx, grads);
    const c10::cuda::CUDAGuard guard(x.device());
    const auto n = x.size(0), v = x.size(1);
    auto gx = torch::empty_like(x);
    const auto stream = at::cuda::getCurrentCUDAStream().stream();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "unirl_cuda_logprob_backward", [&] {
      check(ops::cuda::logprob_backward<scalar_t>(x.data_ptr<scalar_t>(), t.data_ptr<std::int64_t>(),
                                                  lse.data_ptr<scalar_t>(), ent.data_ptr<scalar_t>(),
                                                  gl.data_ptr<scalar_t>(), gh.data_ptr<scalar_t>(), n, v,
                                                  gx.data_ptr<scalar_t>(), stream));
    });
    return {gx, torch::Tensor()};
  }
};
#endif

}  // namespace detail

/// `log p(target)` and the entropy of each row of `logits`, with the implementation chosen by
/// the execution policy: `exec::cpu` fused loops, `exec::cuda` the CUDA kernels (when unirl was
/// built with `UNIRL_ENABLE_CUDA`), `exec::reference` LibTorch ops; `exec::automatic` by device.
template <ExecutionPolicy Exec = exec::automatic>
logprob_result token_logprob(const torch::Tensor& logits, const torch::Tensor& targets) {
  const auto t = detail::check_logprob_args(logits, targets);
  return exec::dispatch<Exec>(
      logits, [&] { return detail::logprob_reference(logits, t); },
      [&] {
        auto out = detail::fused_logprob::apply(logits, t);
        return logprob_result{out[0], out[1]};
      }
#if defined(UNIRL_WITH_CUDA_KERNELS)
      ,
      [&] {
        auto out = detail::cuda_logprob::apply(logits, t.to(logits.device()));
        return logprob_result{out[0], out[1]};
      }
#endif
  );
}

namespace detail {

// The row work of the chunked LM head on LibTorch ops (any device): log-sum-exp, entropy and log p
// of a chunk's logits, and the logits' gradient.
struct chunk_rows_libtorch {
  // x: the chunk's logits (rows, V), overwritten; l: a (rows, V) buffer.
  static void forward(torch::Tensor& x, torch::Tensor& l, const torch::Tensor& t, torch::Tensor logp,
                      torch::Tensor lse, torch::Tensor ent) {
    const auto t1 = t.unsqueeze(1);
    at::_log_softmax_out(l, x, 1, false);                        // log p
    const auto lp = l.gather(1, t1).squeeze(1);
    logp.copy_(lp);
    lse.copy_(x.gather(1, t1).squeeze(1) - lp);                  // log-sum-exp = logit_t - log p_t
    torch::exp_out(x, l).mul_(l);                                // p log p
    torch::sum_out(ent, x, {1}).neg_();
  }
  // d logp_t / dx_j = [j = t] - p_j ;  d H / dx_j = -p_j (log p_j + H), so with a = g_ent and
  // b = g_logp + g_ent H per row: d/dx_j = -p_j (a log p_j + b) + [j = t] g_logp. Returns the
  // gradient, in x or p.
  static torch::Tensor& backward(torch::Tensor& x, torch::Tensor& p, const torch::Tensor& t, const torch::Tensor& lse,
                                 const torch::Tensor& ent, const torch::Tensor& g_logp, const torch::Tensor& g_ent) {
    x.sub_(lse.unsqueeze(1));  // log p
    torch::exp_out(p, x);
    x.mul_(g_ent.unsqueeze(1)).add_((g_logp + g_ent * ent).unsqueeze(1)).mul_(p).neg_();
    x.scatter_add_(1, t.unsqueeze(1), g_logp.unsqueeze(1));
    return x;
  }
};

#if defined(UNIRL_WITH_CUDA_KERNELS)
// The same row work on CUDA tensors through the token log-prob kernels (ops/cuda/logprob.cuh): one
// pass per row instead of LibTorch's five.
struct chunk_rows_cuda {
  static void forward(torch::Tensor& x, torch::Tensor&, const torch::Tensor& t, torch::Tensor logp, torch::Tensor lse,
                      torch::Tensor ent) {
    const auto n = x.size(0), v = x.size(1);
    const auto stream = at::cuda::getCurrentCUDAStream().stream();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "unirl_cuda_chunk_logprob", [&] {
      cuda_logprob::check(ops::cuda::logprob_forward<scalar_t>(x.data_ptr<scalar_t>(), t.data_ptr<std::int64_t>(), n,
                                                               v, logp.data_ptr<scalar_t>(), ent.data_ptr<scalar_t>(),
                                                               lse.data_ptr<scalar_t>(), stream));
    });
  }
  static torch::Tensor& backward(torch::Tensor& x, torch::Tensor& p, const torch::Tensor& t, const torch::Tensor& lse,
                                 const torch::Tensor& ent, const torch::Tensor& g_logp, const torch::Tensor& g_ent) {
    const auto n = x.size(0), v = x.size(1);
    const auto stream = at::cuda::getCurrentCUDAStream().stream();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "unirl_cuda_chunk_logprob_backward", [&] {
      cuda_logprob::check(ops::cuda::logprob_backward<scalar_t>(
          x.data_ptr<scalar_t>(), t.data_ptr<std::int64_t>(), lse.data_ptr<scalar_t>(), ent.data_ptr<scalar_t>(),
          g_logp.data_ptr<scalar_t>(), g_ent.data_ptr<scalar_t>(), n, v, p.data_ptr<scalar_t>(), stream));
    });
    return p;
  }
};
#endif

// The LM head and the log-probabilities in row chunks: forward keeps only (N,) results, and the
// backward recomputes each chunk's logits, so memory is O(chunk * V) instead of O(N * V). Two
// (chunk, V) buffers serve every chunk, and the head's gradient accumulates in place
// (addmm_), so no (V, D) temporary is made per chunk. `Rows` does the per-row work.
template <class Rows>
struct chunked_linear_logprob : torch::autograd::Function<chunked_linear_logprob<Rows>> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor hidden,
                                                torch::Tensor weight, torch::Tensor targets, std::int64_t chunk) {
    torch::NoGradGuard no_grad;
    const auto n = hidden.size(0), v = weight.size(0);
    auto logp = torch::empty({n}, hidden.options());
    auto ent = torch::empty({n}, hidden.options());
    auto lse = torch::empty({n}, hidden.options());
    const auto rows = std::max<std::int64_t>(1, std::min(chunk, n));
    auto x_buf = torch::empty({rows, v}, hidden.options()), l_buf = torch::empty({rows, v}, hidden.options());
    const auto wt = weight.t();
    for (std::int64_t lo = 0; lo < n; lo += chunk) {
      const auto hi = std::min(n, lo + chunk);
      auto x = x_buf.slice(0, 0, hi - lo), l = l_buf.slice(0, 0, hi - lo);
      torch::mm_out(x, hidden.slice(0, lo, hi), wt);  // logits
      Rows::forward(x, l, targets.slice(0, lo, hi), logp.slice(0, lo, hi), lse.slice(0, lo, hi), ent.slice(0, lo, hi));
    }
    ctx->save_for_backward({hidden, weight, targets, lse, ent});
    ctx->saved_data["chunk"] = chunk;
    return {logp, ent};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3], &ent = saved[4];
    const auto chunk = ctx->saved_data["chunk"].toInt();
    const auto n = hidden.size(0), v = weight.size(0);
    const auto g_logp = grads[0].defined() ? grads[0].contiguous() : torch::zeros({n}, hidden.options());
    const auto g_ent = grads[1].defined() ? grads[1].contiguous() : torch::zeros({n}, hidden.options());
    // A frozen head (LoRA keeps the base weights, tied embeddings included, out of training)
    // gets no gradient: no (V, D) buffer and a third less work in this backward.
    const bool want_weight = ctx->needs_input_grad(1), want_hidden = ctx->needs_input_grad(0);
    auto g_hidden = want_hidden ? torch::empty_like(hidden) : torch::Tensor();
    auto g_weight = want_weight ? torch::zeros_like(weight) : torch::Tensor();
    const auto rows = std::max<std::int64_t>(1, std::min(chunk, n));
    auto x_buf = torch::empty({rows, v}, hidden.options()), p_buf = torch::empty({rows, v}, hidden.options());
    const auto wt = weight.t();
    for (std::int64_t lo = 0; lo < n; lo += chunk) {
      const auto hi = std::min(n, lo + chunk);
      auto x = x_buf.slice(0, 0, hi - lo), p = p_buf.slice(0, 0, hi - lo);
      const auto h = hidden.slice(0, lo, hi);
      torch::mm_out(x, h, wt);  // logits
      const auto& gx = Rows::backward(x, p, targets.slice(0, lo, hi), lse.slice(0, lo, hi), ent.slice(0, lo, hi),
                                      g_logp.slice(0, lo, hi), g_ent.slice(0, lo, hi));
      if (want_hidden) {
        auto gh = g_hidden.slice(0, lo, hi);
        torch::mm_out(gh, gx, weight);
      }
      if (want_weight) g_weight.addmm_(gx.t(), h);
    }
    return {g_hidden, g_weight, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace detail

/// `token_logprob(hidden @ weight^T, targets)` computed `chunk` rows at a time: the (N, V)
/// logits are never materialised, in the forward or the backward (which recomputes them per
/// chunk). hidden (N, D), weight (V, D) — the LM head — targets (N,) int64. `exec::reference`
/// materialises the logits (`token_logprob<exec::reference>(hidden @ weight^T, targets)`, the
/// test oracle); `exec::cpu` (and `exec::automatic` on the CPU) chunks with LibTorch's row ops;
/// `exec::cuda` (and `exec::automatic` on CUDA, when built with `UNIRL_ENABLE_CUDA`) chunks with
/// the token log-prob kernels for the rows' work.
template <ExecutionPolicy Exec = exec::automatic>
logprob_result linear_logprob(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                              std::int64_t chunk = 1024) {
  UNIRL_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "linear_logprob: hidden (N, D) and weight (V, D) expected, got ", hidden.sizes(), " and ",
              weight.sizes());
  UNIRL_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "linear_logprob: targets must be (",
              hidden.size(0), ",), got ", targets.sizes());
  UNIRL_CHECK(chunk >= 1, "linear_logprob: chunk = ", chunk, ": expected >= 1");
  const auto t = detail::check_vocabulary(targets, weight.size(0), "linear_logprob");
  auto chunked = [&]<class Rows>(Rows) {
    auto out = detail::chunked_linear_logprob<Rows>::apply(hidden, weight, t.contiguous(), chunk);
    return logprob_result{out[0], out[1]};
  };
  return exec::dispatch<Exec>(
      hidden, [&] { return token_logprob<exec::reference>(torch::mm(hidden, weight.t()), t); },
      [&] { return chunked(detail::chunk_rows_libtorch{}); }
#if defined(UNIRL_WITH_CUDA_KERNELS)
      ,
      [&] {
        const auto st = hidden.scalar_type();
        if (st == torch::kFloat || st == torch::kDouble) return chunked(detail::chunk_rows_cuda{});
        return chunked(detail::chunk_rows_libtorch{});
      }
#endif
  );
}

}  // namespace unirl::ops
