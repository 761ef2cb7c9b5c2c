// Rollout batches that reflect their fields (core/batch.hpp): select / trim / concat / to are
// written once over a batch's members, so a new field survives every one of them. Expected
// values are written out by hand (index by index), not produced by the functions under test.
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <unirl/core/batch.hpp>
#include <unirl/rollout/env.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/token.hpp>

using Catch::Matchers::Contains;

namespace {

// A token batch grown by the fields a vision-language or asynchronous setup adds: an image per
// sample, a per-sample vector, a per-token tensor, a palette shared by all samples, a policy
// version and a layout figure. Written as a user would write it: the struct, the tags, the adaptation.
struct vlm_rollout {
  torch::Tensor prompt_ids;       // (B, P) int64, left-padded
  torch::Tensor prompt_mask;      // (B, P) float
  torch::Tensor completion_ids;   // (B, T) int64, right-padded
  torch::Tensor completion_mask;  // (B, T) float
  torch::Tensor token_version;    // (B, T) int64: the new per-token field
  torch::Tensor images;           // (B, C, H, W): the new per-sample tensor
  std::vector<std::string> image_ids{};  // (B): the new per-sample vector
  torch::Tensor palette;          // (K, 3): the same for every sample
  std::int64_t policy_version = 0;  // which weights drew the batch
  std::int64_t groups = 0;          // how many prompt groups the batch was drawn as (layout)

  using shared_fields = unirl::batch::fields<"palette", "policy_version">;
  using layout_fields = unirl::batch::fields<"groups">;
  using ragged_columns = unirl::batch::column_groups<
      unirl::batch::columns<unirl::batch::pad_side::left, "prompt_mask", "prompt_ids">,
      unirl::batch::columns<unirl::batch::pad_side::right, "completion_mask", "completion_ids", "token_version">>;

  std::int64_t size() const { return images.defined() ? images.size(0) : 0; }
};

}  // namespace

BOOST_HANA_ADAPT_STRUCT(vlm_rollout, prompt_ids, prompt_mask, completion_ids, completion_mask, token_version, images,
                        image_ids, palette, policy_version, groups);

namespace {

torch::Tensor i64(std::vector<std::vector<std::int64_t>> rows) {
  std::vector<torch::Tensor> r;
  for (auto& row : rows) r.push_back(torch::tensor(row, torch::kInt64));
  return torch::stack(r);
}
torch::Tensor f32(std::vector<std::vector<float>> rows) {
  std::vector<torch::Tensor> r;
  for (auto& row : rows) r.push_back(torch::tensor(row, torch::kFloat));
  return torch::stack(r);
}
bool same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && b.defined() && a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         torch::equal(a, b);
}

// Three samples. Prompt column 0 is padding in every row; completion column 3 too.
vlm_rollout three() {
  vlm_rollout b;
  b.prompt_ids = i64({{0, 0, 5}, {0, 6, 7}, {0, 0, 8}});
  b.prompt_mask = f32({{0, 0, 1}, {0, 1, 1}, {0, 0, 1}});
  b.completion_ids = i64({{1, 2, 0, 0}, {3, 0, 0, 0}, {4, 5, 6, 0}});
  b.completion_mask = f32({{1, 1, 0, 0}, {1, 0, 0, 0}, {1, 1, 1, 0}});
  b.token_version = i64({{7, 7, 0, 0}, {7, 0, 0, 0}, {7, 7, 7, 0}});
  b.images = torch::arange(3 * 2 * 2 * 2, torch::kFloat).reshape({3, 2, 2, 2});
  b.image_ids = {"img-a", "img-b", "img-c"};
  b.palette = f32({{0.1f, 0.2f, 0.3f}, {0.4f, 0.5f, 0.6f}});
  b.policy_version = 7;
  b.groups = 3;
  return b;
}

}  // namespace

TEST_CASE("batch::select: a new tensor field and a new vector field follow the index", "[cpu][batch]") {
  const auto b = three();
  const auto s = unirl::batch::select(b, torch::tensor({2, 0, 2}, torch::kInt64));
  CHECK(s.size() == 3);
  CHECK(same(s.images, torch::stack({b.images[2], b.images[0], b.images[2]})));
  CHECK(s.image_ids == std::vector<std::string>{"img-c", "img-a", "img-c"});
  CHECK(same(s.token_version, i64({{7, 7, 7, 0}, {7, 7, 0, 0}, {7, 7, 7, 0}})));
  CHECK(same(s.prompt_ids, i64({{0, 0, 8}, {0, 0, 5}, {0, 0, 8}})));
  CHECK(same(s.completion_mask, f32({{1, 1, 1, 0}, {1, 1, 0, 0}, {1, 1, 1, 0}})));
  CHECK(same(s.palette, b.palette));  // shared: copied whole
  CHECK(s.policy_version == 7);
  CHECK(s.groups == 0);  // layout: the selection is no longer drawn as 3 groups

  // An empty per-sample vector stays empty; an undefined tensor stays undefined.
  auto bare = b;
  bare.image_ids.clear();
  bare.token_version = torch::Tensor{};
  const auto s2 = unirl::batch::select(bare, torch::tensor({1}, torch::kInt64));
  CHECK(s2.image_ids.empty());
  CHECK_FALSE(s2.token_version.defined());
  CHECK(same(s2.images, b.images.slice(0, 1, 2)));

  CHECK_THROWS_WITH(unirl::batch::select(b, torch::zeros({2, 2}, torch::kInt64)), Contains("index must be 1-D"));
  auto short_ids = b;
  short_ids.image_ids.pop_back();  // 2 ids for 3 samples
  CHECK_THROWS_WITH(unirl::batch::select(short_ids, torch::tensor({2}, torch::kInt64)),
                    Contains("'image_ids'"));
}

TEST_CASE("batch::trim: padding columns dropped per ragged group, every other field kept", "[cpu][batch]") {
  const auto b = three();
  const auto t = unirl::batch::trim(b);
  CHECK(same(t.prompt_ids, i64({{0, 5}, {6, 7}, {0, 8}})));
  CHECK(same(t.prompt_mask, f32({{0, 1}, {1, 1}, {0, 1}})));
  CHECK(same(t.completion_ids, i64({{1, 2, 0}, {3, 0, 0}, {4, 5, 6}})));
  CHECK(same(t.token_version, i64({{7, 7, 0}, {7, 0, 0}, {7, 7, 7}})));  // the new per-token field is cut too
  CHECK(same(t.images, b.images));
  CHECK(t.image_ids == b.image_ids);
  CHECK(same(t.palette, b.palette));
  CHECK(t.policy_version == 7);
  CHECK(t.groups == 3);  // same rows: the layout still holds

  // All-padding masks keep one column per group (as token_rollout::trimmed always did).
  auto empty = b;
  empty.completion_mask = torch::zeros_like(b.completion_mask);
  CHECK(unirl::batch::trim(empty).completion_ids.size(1) == 1);
}

TEST_CASE("batch::concat: ragged parts padded per group; shared fields checked; layout reset", "[cpu][batch]") {
  const auto b = three();
  auto narrow = unirl::batch::select(b, torch::tensor({1}, torch::kInt64));  // then made narrower:
  narrow = unirl::batch::trim(narrow);  // prompt (1, 2), completion (1, 1)
  narrow.groups = 1;
  REQUIRE(narrow.prompt_ids.size(1) == 2);
  REQUIRE(narrow.completion_ids.size(1) == 1);
  const auto c = unirl::batch::concat(std::vector<vlm_rollout>{narrow, b}, [](std::string_view member) {
    return member == "prompt_ids" || member == "completion_ids" ? 9.0 : 0.0;
  });
  CHECK(c.size() == 4);
  // The narrow part is padded on the left of its prompt and the right of its completion.
  CHECK(same(c.prompt_ids, i64({{9, 6, 7}, {0, 0, 5}, {0, 6, 7}, {0, 0, 8}})));
  CHECK(same(c.prompt_mask, f32({{0, 1, 1}, {0, 0, 1}, {0, 1, 1}, {0, 0, 1}})));
  CHECK(same(c.completion_ids, i64({{3, 9, 9, 9}, {1, 2, 0, 0}, {3, 0, 0, 0}, {4, 5, 6, 0}})));
  CHECK(same(c.token_version, i64({{7, 0, 0, 0}, {7, 7, 0, 0}, {7, 0, 0, 0}, {7, 7, 7, 0}})));
  CHECK(same(c.images, torch::stack({b.images[1], b.images[0], b.images[1], b.images[2]})));
  CHECK(c.image_ids == std::vector<std::string>{"img-b", "img-a", "img-b", "img-c"});
  CHECK(same(c.palette, b.palette));
  CHECK(c.policy_version == 7);
  CHECK(c.groups == 0);

  auto other_version = b;
  other_version.policy_version = 8;
  CHECK_THROWS_WITH(unirl::batch::concat(std::vector<vlm_rollout>{b, other_version}),
                    Contains("shared member 'policy_version' differs"));
  auto other_palette = b;
  other_palette.palette = b.palette + 1;
  CHECK_THROWS_WITH(unirl::batch::concat(std::vector<vlm_rollout>{b, other_palette}),
                    Contains("shared member 'palette' differs"));
  auto no_ids = b;
  no_ids.image_ids.clear();
  CHECK_THROWS_WITH(unirl::batch::concat(std::vector<vlm_rollout>{b, no_ids}),
                    Contains("member 'image_ids' is empty in some parts only"));
  auto no_version = b;
  no_version.token_version = torch::Tensor{};
  CHECK_THROWS_WITH(unirl::batch::concat(std::vector<vlm_rollout>{b, no_version}),
                    Contains("member 'token_version' is defined in some parts only"));
}

TEST_CASE("batch::to: every tensor member moves, the rest is copied", "[cpu][batch]") {
  const auto b = three();
  // The meta device stands in for an accelerator on a CPU-only machine: a real move of every tensor.
  const auto m = unirl::batch::to(b, torch::Device(torch::kMeta));
  for (const auto* t : {&m.prompt_ids, &m.prompt_mask, &m.completion_ids, &m.completion_mask, &m.token_version,
                        &m.images, &m.palette})
    CHECK(t->device().type() == torch::kMeta);
  CHECK(m.images.sizes() == b.images.sizes());
  CHECK(m.image_ids == b.image_ids);
  CHECK(m.policy_version == 7);
  CHECK(m.groups == 3);
  CHECK(b.images.device().type() == torch::kCPU);  // the source is untouched
}

TEST_CASE("token_rollout: select, trimmed and concat_rollouts keep their documented behaviour", "[cpu][batch][token]") {
  unirl::token_rollout r;
  r.prompt_ids = i64({{0, 4}, {5, 6}});
  r.prompt_mask = f32({{0, 1}, {1, 1}});
  r.completion_ids = i64({{1, 2, 0}, {3, 0, 0}});
  r.completion_mask = f32({{1, 1, 0}, {1, 0, 0}});
  r.old_logp = f32({{-1, -2, 0}, {-3, 0, 0}});
  r.ref_logp = f32({{-1.5f, -2.5f, 0}, {-3.5f, 0, 0}});
  r.prompt_index = torch::tensor({0, 1}, torch::kInt64);
  r.prompts = {"p0", "p1"};
  r.completions = {"c0", "c1"};
  r.references = {"r0", "r1"};

  const auto s = r.select(torch::tensor({1, 1, 0}, torch::kInt64));
  CHECK(same(s.old_logp, f32({{-3, 0, 0}, {-3, 0, 0}, {-1, -2, 0}})));
  CHECK(same(s.prompt_index, torch::tensor({1, 1, 0}, torch::kInt64)));
  CHECK(s.completions == std::vector<std::string>{"c1", "c1", "c0"});
  CHECK_FALSE(s.values.defined());

  const auto t = r.trimmed();
  CHECK(same(t.completion_ids, i64({{1, 2}, {3, 0}})));  // completion column 2 is padding everywhere
  CHECK(same(t.ref_logp, f32({{-1.5f, -2.5f}, {-3.5f, 0}})));
  CHECK(same(t.prompt_ids, r.prompt_ids));  // prompt column 0 is real in row 1
  CHECK(same(t.prompt_index, r.prompt_index));

  // A narrower part (prompt width 1, completion width 1) joins r: prompts left-padded with the
  // pad id, completions right-padded with it, every other padded slot 0.
  unirl::token_rollout n;
  n.prompt_ids = i64({{7}});
  n.prompt_mask = f32({{1}});
  n.completion_ids = i64({{2}});
  n.completion_mask = f32({{1}});
  n.old_logp = f32({{-0.5f}});
  n.ref_logp = f32({{-0.25f}});
  n.prompt_index = torch::tensor({2}, torch::kInt64);
  n.prompts = {"p2"};
  n.completions = {"c2"};
  n.references = {"r2"};
  const auto c = unirl::concat_rollouts({r, n}, /*pad_id=*/11);
  CHECK(same(c.prompt_ids, i64({{0, 4}, {5, 6}, {11, 7}})));
  CHECK(same(c.prompt_mask, f32({{0, 1}, {1, 1}, {0, 1}})));
  CHECK(same(c.completion_ids, i64({{1, 2, 0}, {3, 0, 0}, {2, 11, 11}})));
  CHECK(same(c.completion_mask, f32({{1, 1, 0}, {1, 0, 0}, {1, 0, 0}})));
  CHECK(same(c.ref_logp, f32({{-1.5f, -2.5f, 0}, {-3.5f, 0, 0}, {-0.25f, 0, 0}})));
  CHECK(same(c.prompt_index, torch::tensor({0, 1, 2}, torch::kInt64)));
  CHECK(c.references == std::vector<std::string>{"r0", "r1", "r2"});
  CHECK_FALSE(c.advantages.defined());
}

TEST_CASE("env_rollout and flow_rollout: rows selected and concatenated, the (T, N) layout dropped",
          "[cpu][batch][env][flow]") {
  unirl::env_rollout e;
  e.obs = f32({{0, 0}, {1, 1}, {2, 2}, {3, 3}});
  e.actions = torch::tensor({0, 1, 1, 0}, torch::kInt64);
  for (auto* t : {&e.logprobs, &e.rewards, &e.dones, &e.values, &e.advantages, &e.returns})
    *t = torch::tensor({0.5f, 1.5f, 2.5f, 3.5f});
  e.next_value = torch::tensor({9.0f, 8.0f});
  e.next_done = torch::tensor({0.0f, 1.0f});
  e.num_steps = 2;
  e.num_envs = 2;
  const auto mb = e.select(torch::tensor({3, 1}, torch::kInt64));
  CHECK(same(mb.obs, f32({{3, 3}, {1, 1}})));
  CHECK(same(mb.returns, torch::tensor({3.5f, 1.5f})));
  CHECK_FALSE(mb.next_value.defined());
  CHECK_FALSE(mb.next_done.defined());
  CHECK(mb.num_steps == 0);
  CHECK(mb.num_envs == 0);
  const auto both = unirl::batch::concat(std::vector<unirl::env_rollout>{e, mb});
  CHECK(both.size() == 6);
  CHECK(same(both.actions, torch::tensor({0, 1, 1, 0, 0, 1}, torch::kInt64)));
  CHECK(both.num_steps == 0);
  CHECK_FALSE(both.next_value.defined());
  const auto moved = unirl::batch::to(e, torch::Device(torch::kMeta));
  CHECK(moved.next_value.device().type() == torch::kMeta);  // layout tensors move with the batch
  CHECK(moved.num_steps == 2);

  unirl::flow_rollout f;
  f.conditions = torch::tensor({3, 4, 5}, torch::kInt64);
  f.trajectory = torch::arange(3 * 3 * 2, torch::kFloat).reshape({3, 3, 2});  // K = 2 steps, S = (2,)
  f.means = torch::arange(3 * 2 * 2, torch::kFloat).reshape({3, 2, 2});
  f.stds = torch::full({3, 2}, 0.5, torch::kFloat64);
  f.log_probs = torch::zeros({3, 2});
  f.timesteps = torch::tensor({1.0, 0.5, 0.0}, torch::kFloat64).expand({3, 3}).contiguous();
  const auto fs = f.select(torch::tensor({2, 0}, torch::kInt64));
  CHECK(same(fs.conditions, torch::tensor({5, 3}, torch::kInt64)));
  CHECK(same(fs.trajectory, torch::stack({f.trajectory[2], f.trajectory[0]})));
  CHECK_FALSE(fs.advantages.defined());
  const auto fc = unirl::batch::concat(std::vector<unirl::flow_rollout>{fs, f});
  CHECK(same(fc.means, torch::stack({f.means[2], f.means[0], f.means[0], f.means[1], f.means[2]})));
  CHECK(fc.steps() == 2);
}
