#pragma once
/// \file paged_attention.hpp
/// Attention over a paged KV cache (`paged_kv`, `paged_batch` in concepts/causal_lm.hpp): writes
/// the new keys and values of a packed batch into their pool slots, then attends each sequence's
/// queries to its own context slots — the decoding sequences (one query each) together, through
/// one gather of their slots padded to the longest context (padding masked with -inf, which adds
/// exact zeros: the result does not depend on what else is decoded), each prefill chunk on its
/// own. The projections around it run on all N packed tokens at once.
///
/// ```cpp
/// // q (N, H, Dh), k and v (N, H_kv, Dh) of the batch's tokens; kv.k[l], kv.v[l] (slots, H_kv, Dh)
/// auto y = unirl::ops::paged_attention(q, k, v, kv.k[l], kv.v[l], batch,
///     [&](auto& q4, auto& k4, auto& v4, auto& bias) { return unirl::ops::attention(q4, k4, v4, bias, scale); });
/// // y (N, H, Dh)
/// ```
#include <cstdint>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>

namespace unirl::ops {

/// `attend(q (B, H, n, Dh), k (B, H_kv, S, Dh), v, bias (B, 1, n, S)) -> (B, H, n, Dh)` is the
/// model's attention (its grouped-query handling, its precision); this function lays the paged
/// batch out for it. q (N, H, Dh), k_new / v_new (N, H_kv, Dh); k_pool / v_pool (slots, H_kv, Dh)
/// receive the new keys and values at `b.write_slots`. Returns (N, H, Dh). Without gradients.
template <class Attend>
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                              torch::Tensor& k_pool, torch::Tensor& v_pool, const paged_batch& b, Attend&& attend) {
  UNIRL_CHECK(q.dim() == 3 && k_new.dim() == 3 && k_new.sizes() == v_new.sizes() && k_new.size(0) == q.size(0),
              "paged_attention: q ", q.sizes(), ", k ", k_new.sizes(), ", v ", v_new.sizes(),
              ": expected (N, H, Dh) and (N, H_kv, Dh)");
  UNIRL_CHECK(b.write_slots.defined() && b.write_slots.numel() == q.size(0), "paged_attention: ",
              b.write_slots.defined() ? b.write_slots.numel() : 0, " write slots for ", q.size(0), " tokens");
  UNIRL_CHECK(k_pool.dim() == 3 && k_pool.size(1) == k_new.size(1) && k_pool.size(2) == k_new.size(2),
              "paged_attention: the pool ", k_pool.sizes(), " does not hold keys of sizes ", k_new.sizes());
  torch::NoGradGuard ng;
  k_pool.index_copy_(0, b.write_slots, k_new.to(k_pool.scalar_type()));
  v_pool.index_copy_(0, b.write_slots, v_new.to(v_pool.scalar_type()));
  const auto H = q.size(1), Hkv = k_new.size(1), D = q.size(2);
  auto out = torch::empty_like(q);
  if (b.decode_rows.defined() && b.decode_rows.numel() > 0) {
    const auto S = b.decode_slots.size(0), C = b.decode_slots.size(1);
    const auto flat = b.decode_slots.reshape({-1});
    const auto k = k_pool.index_select(0, flat).view({S, C, Hkv, D}).permute({0, 2, 1, 3});  // (S, H_kv, C, Dh)
    const auto v = v_pool.index_select(0, flat).view({S, C, Hkv, D}).permute({0, 2, 1, 3});
    const auto qd = q.index_select(0, b.decode_rows).unsqueeze(2);                          // (S, H, 1, Dh)
    out.index_copy_(0, b.decode_rows, attend(qd, k, v, b.decode_bias).view({S, H, D}));
  }
  for (const auto& c : b.chunks) {
    const auto k = k_pool.index_select(0, c.context_slots).permute({1, 0, 2}).unsqueeze(0);  // (1, H_kv, ctx, Dh)
    const auto v = v_pool.index_select(0, c.context_slots).permute({1, 0, 2}).unsqueeze(0);
    const auto qc = q.slice(0, c.row, c.row + c.n).permute({1, 0, 2}).unsqueeze(0);          // (1, H, n, Dh)
    out.slice(0, c.row, c.row + c.n).copy_(attend(qc, k, v, c.bias).squeeze(0).permute({1, 0, 2}));
  }
  return out;
}

}  // namespace unirl::ops
