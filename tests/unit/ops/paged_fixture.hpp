#pragma once
// A paged decode batch made by hand for the paged-attention tests: S sequences with the given
// context lengths, each holding distinct random slots of a pool, padded to the longest context
// with slot 0 and a -inf bias, as rollout::make_paged_batch lays them out.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/ops/attention.hpp>
#include <unirl/ops/paged_attention.hpp>

namespace unirl_test {

// The model-side attention for the paged tests: the reference attention with the KV heads
// repeated to the query heads.
inline auto reference_attend(double scale, std::int64_t groups) {
  return [scale, groups](auto& q4, auto& k4, auto& v4, auto& bias) {
    return unirl::ops::attention<unirl::exec::reference>(q4, k4.repeat_interleave(groups, 1),
                                                         v4.repeat_interleave(groups, 1), bias, scale);
  };
}

struct paged_decode_case {
  torch::Tensor q, k_new, v_new, k_pool, v_pool;  // (S, H, D), (S, Hkv, D) x 2, (slots, Hkv, D) x 2
  unirl::paged_batch batch;
  double scale = 0;

  // ops::paged_attention of this batch under Exec with the reference attention (every call
  // writes the same new keys and values into the pools).
  template <class Exec>
  torch::Tensor run() {
    return unirl::ops::paged_attention<Exec>(q, k_new, v_new, k_pool, v_pool, batch, scale,
                                             reference_attend(scale, q.size(1) / k_new.size(1)));
  }
};

inline paged_decode_case make_paged_decode_case(const std::vector<std::int64_t>& context, std::int64_t H,
                                                std::int64_t Hkv, std::int64_t D, std::int64_t pool_slots,
                                                torch::TensorOptions o) {
  const auto S = static_cast<std::int64_t>(context.size());
  const auto C = *std::max_element(context.begin(), context.end());
  paged_decode_case c;
  c.scale = 1.0 / std::sqrt(static_cast<double>(D));
  c.q = torch::randn({S, H, D}, o);
  c.k_new = torch::randn({S, Hkv, D}, o);
  c.v_new = torch::randn({S, Hkv, D}, o);
  c.k_pool = torch::randn({pool_slots, Hkv, D}, o);
  c.v_pool = torch::randn({pool_slots, Hkv, D}, o);
  const auto perm = torch::randperm(pool_slots - 1, torch::kInt64) + 1;  // slot 0 is the padding's
  const auto* pp = perm.data_ptr<std::int64_t>();
  auto slots = torch::zeros({S, C}, torch::kInt64);
  auto bias = torch::full({S, C}, -std::numeric_limits<float>::infinity());
  std::vector<std::int64_t> write;
  std::int64_t next = 0;
  for (std::int64_t s = 0; s < S; ++s) {
    for (std::int64_t j = 0; j < context[static_cast<std::size_t>(s)]; ++j) {
      slots[s][j] = pp[next++];
      bias[s][j] = 0.f;
    }
    write.push_back(slots[s][context[static_cast<std::size_t>(s)] - 1].item<std::int64_t>());
  }
  auto& b = c.batch;
  b.write_slots = torch::tensor(write, torch::kInt64).to(o.device());
  b.decode_rows = torch::arange(S, torch::kInt64).to(o.device());
  b.decode_slots = slots.to(o.device());
  b.decode_bias = bias.view({S, 1, 1, C}).to(o.device());
  b.decode_context = context;
  return c;
}

}  // namespace unirl_test
