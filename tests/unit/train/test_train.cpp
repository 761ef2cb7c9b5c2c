// Training infrastructure: schedules, clipping, the stability guard, the optimizer and its
// exact resume, checkpoint files, metrics / progress output and PNG plots.
#include <torch/torch.h>  // before Catch2: glog's CHECK must not replace Catch2's
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <unirl/train/checkpoint.hpp>
#include <unirl/train/clip.hpp>
#include <unirl/train/guard.hpp>
#include <unirl/train/loss_scaler.hpp>
#include <unirl/train/metrics.hpp>
#include <unirl/train/optimizer.hpp>
#include <unirl/train/plot.hpp>
#include <unirl/train/run_directory.hpp>
#include <unirl/train/schedule.hpp>

#if defined(UNIRL_WITH_STB)
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#include <stb_image.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif

namespace fs = std::filesystem;
namespace tr = unirl::train;
using Catch::Matchers::Contains;

namespace {

// A directory made at run time, removed with its content at the end of the test.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::random_device rd;
    for (int i = 0; i < 100; ++i) {
      path = fs::temp_directory_path() / ("unirl_train_" + std::to_string(rd()) + std::to_string(rd()));
      if (fs::create_directory(path)) return;
    }
    throw std::runtime_error("cannot create a temporary directory");
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Message of the unirl::error (or subclass) that `f` throws; fails the test when none.
template <class E = unirl::error, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("no exception thrown");
  return {};
}

}  // namespace

// ---------------------------------------------------------------- schedule

TEST_CASE("lr_multiplier: warm-up then constant, linear and cosine decay", "[cpu][train]") {
  using tr::lr_multiplier;
  using tr::schedule_kind;
  const tr::schedule_options warm{.warmup_steps = 4};
  CHECK(lr_multiplier(warm, 0) == 0.25);
  CHECK(lr_multiplier(warm, 1) == 0.5);
  CHECK(lr_multiplier(warm, 3) == 1.0);
  CHECK(lr_multiplier(warm, 1000) == 1.0);

  const tr::schedule_options lin{.kind = schedule_kind::linear, .total_steps = 10};
  CHECK(lr_multiplier(lin, 0) == 1.0);
  CHECK(lr_multiplier(lin, 5) == Approx(0.5).margin(1e-15));
  CHECK(lr_multiplier(lin, 10) == 0.0);
  CHECK(lr_multiplier(lin, 25) == 0.0);

  // Warm-up 2, decay over steps 2..12 to 0.1: the midpoint (step 7) is 0.1 + 0.9 * 0.5.
  const tr::schedule_options cos{.kind = schedule_kind::cosine, .warmup_steps = 2, .total_steps = 12,
                                 .min_lr_ratio = 0.1};
  CHECK(lr_multiplier(cos, 0) == 0.5);
  CHECK(lr_multiplier(cos, 2) == 1.0);
  CHECK(lr_multiplier(cos, 7) == Approx(0.55).margin(1e-12));
  // A fifth of the way (step 4): 0.1 + 0.9 * (1 + cos(0.2 pi)) / 2.
  CHECK(lr_multiplier(cos, 4) == Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.2))).margin(1e-12));
  CHECK(lr_multiplier(cos, 12) == Approx(0.1).margin(1e-12));
  CHECK(lr_multiplier(cos, 100) == Approx(0.1).margin(1e-12));
  auto lin_min = cos;
  lin_min.kind = schedule_kind::linear;
  CHECK(lr_multiplier(lin_min, 7) == Approx(0.55).margin(1e-12));
  CHECK(lr_multiplier(lin_min, 4) == Approx(0.1 + 0.9 * 0.8).margin(1e-12));

  // Unknown total: no decay whatever the kind.
  CHECK(lr_multiplier({.kind = schedule_kind::cosine, .warmup_steps = 0, .total_steps = 0}, 50) == 1.0);
  CHECK(lr_multiplier({.kind = schedule_kind::constant, .total_steps = 10}, 9) == 1.0);
}

TEST_CASE("schedule_options: validation and reflection", "[cpu][train]") {
  tr::schedule_options s{.warmup_steps = 20, .total_steps = 10};
  CHECK_THAT(error_of<unirl::config_error>([&] { unirl::options::validate(s); }), Contains("warmup_steps") && Contains("20"));
  s = {.min_lr_ratio = 1.5};
  CHECK_THAT(error_of<unirl::config_error>([&] { unirl::options::validate(s); }), Contains("min_lr_ratio") && Contains("1.5"));
  s = {};
  unirl::options::set(s, "kind", "cosine");
  CHECK(s.kind == tr::schedule_kind::cosine);
  CHECK(unirl::options::to_json(s)["kind"] == "cosine");
  CHECK_THROWS_AS(unirl::options::set(s, "kind", "step"), unirl::config_error);
}

// ---------------------------------------------------------------- clipping

TEST_CASE("grad_norm and clip_grad_norm against hand-computed values", "[cpu][train]") {
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({1}, torch::requires_grad());
  auto c = torch::zeros({3}, torch::requires_grad());  // never gets a gradient
  a.mutable_grad() = torch::tensor({3.0f, 4.0f});
  b.mutable_grad() = torch::tensor({12.0f});
  const std::vector<torch::Tensor> ps{a, b, c};
  CHECK(tr::grad_norm(ps) == Approx(13.0).epsilon(1e-12));   // sqrt(9 + 16 + 144)
  CHECK(tr::grad_norm({c}) == 0.0);

  // Below the threshold: untouched, the norm is returned.
  CHECK(tr::clip_grad_norm(ps, 20.0) == Approx(13.0));
  CHECK(a.grad()[0].item<float>() == 3.0f);

  // Above: every gradient scaled by 6.5 / (13 + 1e-6).
  CHECK(tr::clip_grad_norm(ps, 6.5) == Approx(13.0));
  const double coef = 6.5 / (13.0 + 1e-6);
  CHECK(a.grad()[0].item<float>() == Approx(3.0 * coef).epsilon(1e-6));
  CHECK(a.grad()[1].item<float>() == Approx(4.0 * coef).epsilon(1e-6));
  CHECK(b.grad()[0].item<float>() == Approx(12.0 * coef).epsilon(1e-6));
  CHECK(tr::grad_norm(ps) == Approx(6.5).epsilon(1e-6));

  // Non-finite: reported, gradients left alone.
  b.mutable_grad() = torch::tensor({std::numeric_limits<float>::quiet_NaN()});
  CHECK(std::isnan(tr::clip_grad_norm(ps, 1.0)));
  CHECK(a.grad()[0].item<float>() == Approx(3.0 * coef).epsilon(1e-6));
  b.mutable_grad() = torch::tensor({std::numeric_limits<float>::infinity()});
  CHECK(std::isinf(tr::grad_norm(ps)));

  CHECK_THROWS_AS(unirl::options::validate(tr::clip_options{.max_grad_norm = -1.0}), unirl::config_error);
}

// ---------------------------------------------------------------- guard

TEST_CASE("stability_guard flags spikes against the rolling window", "[cpu][train]") {
  // History {1, 2, 3}: mean 2, population std sqrt(2/3) = 0.8165; sigma 2 -> threshold 3.633.
  const tr::guard_options o{.window = 5, .min_history = 3, .spike_sigma = 2.0};
  {
    tr::stability_guard g(o);
    CHECK_FALSE(g.observe_loss(1));
    CHECK_FALSE(g.observe_loss(2));
    CHECK_FALSE(g.observe_loss(3));
    CHECK_FALSE(g.observe_loss(3.6));
  }
  {
    tr::stability_guard g(o);
    for (double v : {1.0, 2.0, 3.0}) g.observe_loss(v);
    CHECK(g.observe_loss(3.7));
    CHECK((g.loss_history() == std::vector<double>{1, 2, 3, 3.7}));  // the spike entered the window
  }
  {
    // Fewer than min_history values: never a spike.
    tr::stability_guard g(o);
    CHECK_FALSE(g.observe_grad_norm(1.0));
    CHECK_FALSE(g.observe_grad_norm(1e9));
  }
  {
    // A flat history does not flag rounding noise, does flag a real jump.
    tr::stability_guard g(o);
    for (int i = 0; i < 5; ++i) g.observe_loss(1.0);
    CHECK_FALSE(g.observe_loss(1.000001));
    CHECK(g.observe_loss(1.1));
  }
  {
    // Window eviction: only the last 5 values count.
    tr::stability_guard g(o);
    for (double v : {100.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0}) g.observe_loss(v);
    CHECK((g.loss_history() == std::vector<double>{1, 1, 1, 1, 1}));
    CHECK(g.observe_loss(5.0));
  }
  {
    // Non-finite: reported, kept out of the window; disabled: never reported.
    tr::stability_guard g(o);
    CHECK(g.observe_loss(std::nan("")));
    CHECK(g.loss_history().empty());
    tr::stability_guard off({.enabled = false, .window = 5, .min_history = 3});
    for (double v : {1.0, 1.0, 1.0}) off.observe_loss(v);
    CHECK_FALSE(off.observe_loss(1e6));
    CHECK_FALSE(off.observe_loss(INFINITY));
  }
  CHECK(tr::stability_guard::finite(1.0));
  CHECK_FALSE(tr::stability_guard::finite(INFINITY));
  CHECK_FALSE(tr::stability_guard::finite(torch::tensor({1.0f, NAN})));
  CHECK(tr::stability_guard::finite(torch::tensor({1.0f, 2.0f})));
  auto p = torch::zeros({2}, torch::requires_grad());
  p.mutable_grad() = torch::tensor({1.0f, 2.0f});
  CHECK(tr::stability_guard::grads_finite({p}));
  p.mutable_grad() = torch::tensor({1.0f, -INFINITY});
  CHECK_FALSE(tr::stability_guard::grads_finite({p}));

  CHECK_THAT(error_of<unirl::config_error>([] { tr::stability_guard g({.window = 5, .min_history = 8}); }),
             Contains("min_history") && Contains("8"));
}

TEST_CASE("stability_guard windows survive save / load exactly", "[cpu][train]") {
  const tr::guard_options o{.window = 8, .min_history = 4, .spike_sigma = 1.5};
  tr::stability_guard a(o);
  std::mt19937 gen(3);
  std::normal_distribution<double> nd(1.0, 0.2);
  for (int i = 0; i < 20; ++i) {
    a.observe_loss(nd(gen));
    a.observe_grad_norm(nd(gen) * 3);
  }
  a.count_skip();
  a.count_skip();
  temp_dir dir;
  tr::write_checkpoint(dir / "g.ckpt", [&](auto& ar) { a.save(ar); });
  tr::stability_guard b(o);
  tr::read_checkpoint(dir / "g.ckpt", [&](auto& ar) { b.load(ar); });
  CHECK(b.loss_history() == a.loss_history());
  CHECK(b.grad_norm_history() == a.grad_norm_history());
  CHECK(b.skipped_total() == 2);
  for (int i = 0; i < 30; ++i) {
    const double l = nd(gen) * (i % 7 == 0 ? 3.0 : 1.0), n = nd(gen) * (i % 5 == 0 ? 4.0 : 1.0);
    CHECK(a.observe_loss(l) == b.observe_loss(l));
    CHECK(a.observe_grad_norm(n) == b.observe_grad_norm(n));
  }
}

// ---------------------------------------------------------------- optimizer

TEST_CASE("optimizer: parameter groups by name prefix", "[cpu][train]") {
  auto body_w = torch::ones({2, 2}, torch::requires_grad());
  auto body_b = torch::ones({2}, torch::requires_grad());
  auto head_w = torch::ones({1, 2}, torch::requires_grad());
  auto frozen = torch::ones({3});
  const unirl::named_tensors params{{"body.w", body_w}, {"head.w", head_w}, {"body.b", body_b},
                                    {"frozen", frozen}, {"tied", head_w}};
  tr::optimizer opt(params, {.lr = 1e-3, .weight_decay = 0.05,
                             .groups = {{.prefix = "head.", .lr_scale = 10.0, .weight_decay = 0.0,
                                         .max_grad_norm = 0.5},
                                        {.prefix = "unused.", .lr_scale = 2.0}}});
  REQUIRE(opt.group_count() == 2);  // "unused." received nothing and is dropped
  CHECK(opt.group_name(0).empty());
  CHECK(opt.group_name(1) == "head.");
  CHECK(opt.group_params(0).size() == 2);  // frozen left out
  CHECK(opt.group_params(1).size() == 1);  // the tied duplicate optimised once
  CHECK((opt.group_param_names(0) == std::vector<std::string>{"body.w", "body.b"}));
  CHECK(opt.group_max_grad_norm(0) == 0.0);
  CHECK(opt.group_max_grad_norm(1) == 0.5);
  CHECK(opt.group_weight_decay(0) == 0.05);
  CHECK(opt.group_weight_decay(1) == 0.0);
  CHECK(opt.learning_rate() == 1e-3);

  opt.set_lr_multiplier(0.5);
  auto& pg = opt.torch_optimizer().param_groups();
  CHECK(static_cast<torch::optim::AdamWOptions&>(pg[0].options()).lr() == Approx(5e-4));
  CHECK(static_cast<torch::optim::AdamWOptions&>(pg[1].options()).lr() == Approx(5e-3));
  CHECK(opt.learning_rate() == Approx(5e-4));
  CHECK_THROWS_AS(opt.group_params(2), unirl::error);

  CHECK_THAT(error_of<unirl::config_error>([&] { tr::optimizer bad(params, {.lr = 0.0}); }), Contains("optim.lr"));
  CHECK_THAT(error_of<unirl::config_error>([&] {
               tr::optimizer bad(params, {.groups = {{.prefix = "head.", .lr_scale = -1.0}}});
             }),
             Contains("optim.groups[0].lr_scale") && Contains("-1"));
  CHECK_THAT(error_of([&] { tr::optimizer bad({{"frozen", frozen}}, {}); }), Contains("trainable"));

  // Reflection: groups load from a recipe's JSON.
  tr::optimizer_options o;
  unirl::options::from_json(o, nlohmann::json::parse(R"({"lr": 0.002, "groups": [{"prefix": "head.", "lr_scale": 3}]})"));
  CHECK(o.lr == 0.002);
  REQUIRE(o.groups.size() == 1);
  CHECK(o.groups[0].lr_scale == 3.0);
  CHECK(o.groups[0].weight_decay == -1.0);
}

TEST_CASE("optimizer: one AdamW step equals the decoupled-weight-decay formula", "[cpu][train]") {
  // p = 1, g = 0.5, lr = 0.1, wd = 0.1 (head group: inherits), lr_scale 2 for "fast."
  auto p = torch::tensor({1.0}, torch::dtype(torch::kDouble).requires_grad(true));
  auto q = torch::tensor({1.0}, torch::dtype(torch::kDouble).requires_grad(true));
  tr::optimizer opt({{"p", p}, {"fast.q", q}},
                    {.lr = 0.1, .weight_decay = 0.1, .groups = {{.prefix = "fast.", .lr_scale = 2.0}}});
  p.mutable_grad() = torch::tensor({0.5}, torch::kDouble);
  q.mutable_grad() = torch::tensor({0.5}, torch::kDouble);
  opt.step();
  // m = 0.05, v = 2.5e-4; bias-corrected m^ = 0.5, v^ = 0.25: update = lr * 0.5 / (0.5 + eps).
  const double expect_p = 1.0 * (1 - 0.1 * 0.1) - 0.1 * 0.5 / (0.5 + 1e-8);
  const double expect_q = 1.0 * (1 - 0.2 * 0.1) - 0.2 * 0.5 / (0.5 + 1e-8);
  CHECK(p.item<double>() == Approx(expect_p).epsilon(1e-12));
  CHECK(q.item<double>() == Approx(expect_q).epsilon(1e-12));
}

namespace {
struct tiny_net : torch::nn::Module {
  torch::nn::Linear body{nullptr}, head{nullptr};
  tiny_net() {
    body = register_module("body", torch::nn::Linear(4, 8));
    head = register_module("head", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(body(x))); }
  unirl::named_tensors named() {
    unirl::named_tensors out;
    for (const auto& kv : named_parameters()) out.emplace_back(kv.key(), kv.value());
    return out;
  }
};

void train_steps(tiny_net& net, tr::optimizer& opt, const tr::schedule_options& s, std::int64_t from,
                 std::int64_t n) {
  for (std::int64_t k = from; k < from + n; ++k) {
    opt.set_lr_multiplier(tr::lr_multiplier(s, k));
    auto x = torch::randn({16, 4});  // from the global generator: resumed with the checkpoint
    auto loss = (net.forward(x) - x.sum(1, true)).pow(2).mean();
    opt.zero_grad();
    loss.backward();
    tr::clip_grad_norm(opt.parameters(), 1.0);
    opt.step();
  }
}
}  // namespace

TEST_CASE("optimizer + checkpoint: a resumed run is bit-identical", "[cpu][train]") {
  const tr::optimizer_options oo{.lr = 1e-2, .weight_decay = 0.01,
                                 .groups = {{.prefix = "head.", .lr_scale = 3.0, .weight_decay = 0.0}}};
  const tr::schedule_options so{.kind = tr::schedule_kind::cosine, .warmup_steps = 3, .total_steps = 20};
  temp_dir dir;
  const auto path = dir / "run/ckpt.pt";

  torch::manual_seed(7);
  tiny_net a;
  tr::optimizer oa(a.named(), oo);
  train_steps(a, oa, so, 0, 6);
  tr::write_checkpoint(path, [&](torch::serialize::OutputArchive& ar) {
    tr::save_tensors(ar, "policy/", a.named());
    oa.save(ar);
    tr::save_rng(ar);
    tr::write_scalar(ar, "step", std::int64_t{6});
  });
  train_steps(a, oa, so, 6, 7);

  torch::manual_seed(12345);  // another initialisation and another random stream
  tiny_net b;
  tr::optimizer ob(b.named(), oo);
  std::int64_t step = 0;
  tr::read_checkpoint(path, [&](torch::serialize::InputArchive& ar) {
    tr::load_tensors(ar, "policy/", b.named());
    ob.load(ar);
    tr::load_rng(ar);
    step = tr::read_scalar<std::int64_t>(ar, "step");
  });
  CHECK(step == 6);
  CHECK(ob.lr_multiplier() == tr::lr_multiplier(so, 5));
  train_steps(b, ob, so, step, 7);

  const auto pa = a.named(), pb = b.named();
  REQUIRE(pa.size() == pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    CHECK(torch::equal(pa[i].second, pb[i].second));
  }
  // Without the optimizer state the continuation differs: the test can fail.
  torch::manual_seed(12345);
  tiny_net c;
  tr::optimizer oc(c.named(), oo);
  tr::read_checkpoint(path, [&](auto& ar) {
    tr::load_tensors(ar, "policy/", c.named());
    tr::load_rng(ar);
  });
  train_steps(c, oc, so, 6, 7);
  CHECK_FALSE(torch::equal(c.head->weight, a.head->weight));

  // A different group layout is refused with a clear message.
  tr::optimizer od(b.named(), {.lr = 1e-2});
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_checkpoint(path, [&](auto& ar) { od.load(ar); }); }),
             Contains("parameter groups") && Contains(path));
}

TEST_CASE("CUDA: gradient norm, guard, optimizer resume and generator state", "[cuda][train]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device");
    return;
  }
  const torch::Device cuda(torch::kCUDA);
  // grad_norm takes the single-synchronisation path on the device; same value as on the CPU.
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({1}, torch::requires_grad());
  a.mutable_grad() = torch::tensor({3.0f, 4.0f});
  b.mutable_grad() = torch::tensor({12.0f});
  auto ac = a.detach().to(cuda).requires_grad_(), bc = b.detach().to(cuda).requires_grad_();
  ac.mutable_grad() = a.grad().to(cuda);
  bc.mutable_grad() = b.grad().to(cuda);
  CHECK(tr::grad_norm({ac, bc}) == Approx(13.0).epsilon(1e-6));
  CHECK(tr::clip_grad_norm({ac, bc}, 6.5) == Approx(13.0).epsilon(1e-6));
  CHECK(tr::grad_norm({ac, bc}) == Approx(6.5).epsilon(1e-5));
  CHECK(tr::stability_guard::grads_finite({ac, bc}));
  bc.mutable_grad().fill_(NAN);
  CHECK_FALSE(tr::stability_guard::grads_finite({ac, bc}));
  CHECK(std::isnan(tr::grad_norm({ac, bc})));

  temp_dir dir;
  const auto path = dir / "cuda.ckpt";
  torch::manual_seed(5);
  auto p = torch::randn({8, 8}, torch::TensorOptions(cuda).requires_grad(true));
  tr::optimizer o1({{"p", p}}, {.lr = 1e-2, .weight_decay = 0.1});
  const auto step = [&](tr::optimizer& o, torch::Tensor& w) {
    auto x = torch::randn({8, 8}, cuda);
    auto loss = (w.matmul(x)).pow(2).mean();
    o.zero_grad();
    loss.backward();
    o.step();
  };
  for (int i = 0; i < 3; ++i) step(o1, p);
  tr::write_checkpoint(path, [&](auto& ar) {
    tr::save_tensors(ar, "", {{"p", p}});
    o1.save(ar);
    tr::save_rng(ar);
  });
  for (int i = 0; i < 3; ++i) step(o1, p);
  auto q = torch::zeros({8, 8}, torch::TensorOptions(cuda).requires_grad(true));
  tr::optimizer o2({{"p", q}}, {.lr = 1e-2, .weight_decay = 0.1});
  tr::read_checkpoint(path, [&](auto& ar) {
    tr::load_tensors(ar, "", {{"p", q}});
    o2.load(ar);
    tr::load_rng(ar);
  });
  for (int i = 0; i < 3; ++i) step(o2, q);
  CHECK(torch::equal(p, q));
}

// ---------------------------------------------------------------- checkpoint files

TEST_CASE("checkpoint: round trip of tensors, scalars and generator state", "[cpu][train]") {
  temp_dir dir;
  const auto path = dir / "a/b/c.ckpt";
  auto w = torch::randn({2, 3});
  auto v = torch::arange(5, torch::kInt64);
  const std::string json = R"({"lr": 0.001, "name": "x"})";
  torch::manual_seed(99);
  tr::write_checkpoint(path, [&](auto& ar) {
    tr::save_tensors(ar, "m/", {{"layer.weight", w}, {"steps", v}});
    tr::write_scalar(ar, "step", std::int64_t{-42});
    tr::write_scalar(ar, "loss", 0.1 + 0.2);
    tr::write_scalar(ar, "flag", true);
    tr::write_scalar(ar, "options", json);
    tr::save_rng(ar);
  });
  const auto after_save = torch::randn({4});
  const auto bytes = read_bytes(path);
  REQUIRE(bytes.size() > tr::checkpoint_header_size);
  CHECK(bytes.substr(0, 8) == "UNIRLCK1");
  CHECK_FALSE(fs::exists(path + ".tmp"));

  auto w2 = torch::zeros({2, 3});
  auto v2 = torch::zeros({5}, torch::kInt64);
  tr::read_checkpoint(path, [&](auto& ar) {
    tr::load_tensors(ar, "m/", {{"layer.weight", w2}, {"steps", v2}});
    CHECK(tr::read_scalar<std::int64_t>(ar, "step") == -42);
    CHECK(tr::read_scalar<double>(ar, "loss") == 0.1 + 0.2);
    CHECK(tr::read_scalar<bool>(ar, "flag"));
    CHECK(tr::read_scalar<std::string>(ar, "options") == json);
    CHECK(tr::has_key(ar, "step"));
    CHECK_FALSE(tr::has_key(ar, "nope"));
    CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_scalar<double>(ar, "step"); }), Contains("step"));
    CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_scalar<double>(ar, "nope"); }), Contains("nope"));
    tr::load_rng(ar);
  });
  CHECK(torch::equal(w, w2));
  CHECK(torch::equal(v, v2));
  CHECK(torch::equal(torch::randn({4}), after_save));  // the generator is back where it was saved
}

TEST_CASE("checkpoint: damaged files are rejected with the cause", "[cpu][train]") {
  temp_dir dir;
  const auto path = dir / "ok.ckpt";
  tr::write_checkpoint(path, [&](auto& ar) { tr::save_tensors(ar, "", {{"w", torch::randn({64, 64})}}); });
  const auto good = read_bytes(path);
  const auto payload = good.size() - tr::checkpoint_header_size;

  const auto bad = dir / "bad.ckpt";
  const auto noop = [](torch::serialize::InputArchive&) {};
  write_bytes(bad, good.substr(0, good.size() - 100));
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_checkpoint(bad, noop); }),
             Contains(bad) && Contains("truncated: " + std::to_string(payload - 100) + " of " +
                                       std::to_string(payload) + " payload bytes"));
  write_bytes(bad, good.substr(0, 10));
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_checkpoint(bad, noop); }),
             Contains("truncated header: 10 of 32 bytes"));
  auto flipped = good;
  flipped[tr::checkpoint_header_size + payload / 2] ^= 0x10;
  write_bytes(bad, flipped);
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_checkpoint(bad, noop); }),
             Contains("checksum mismatch") && Contains(bad));
  auto magic = good;
  magic[0] = 'X';
  write_bytes(bad, magic);
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_checkpoint(bad, noop); }),
             Contains("not a unirl checkpoint"));
  auto version = good;
  version[8] = 9;
  write_bytes(bad, version);
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_checkpoint(bad, noop); }), Contains("format version 9"));
  write_bytes(bad, good + "xyz");
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_checkpoint(bad, noop); }), Contains("3 unexpected bytes"));
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] { tr::read_checkpoint(dir / "missing.ckpt", noop); }),
             Contains("missing.ckpt") && Contains("no such file"));

  // Contents that do not fit the destination.
  auto small = torch::zeros({3, 2});
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] {
               tr::read_checkpoint(path, [&](auto& ar) { tr::load_tensors(ar, "", {{"w", small}}); });
             }),
             Contains("'w'") && Contains("[64, 64]") && Contains("[3, 2]") && Contains(path));
  CHECK_THAT(error_of<unirl::checkpoint_error>([&] {
               tr::read_checkpoint(path, [&](auto& ar) { tr::load_tensors(ar, "", {{"b", small}}); });
             }),
             Contains("no tensor 'b'"));
  CHECK(torch::count_nonzero(small).item<std::int64_t>() == 0);  // untouched by the failed loads
}

TEST_CASE("checkpoint: an interrupted write leaves the previous file readable", "[cpu][train]") {
  temp_dir dir;
  const auto path = dir / "ckpt.pt";
  tr::write_checkpoint(path, [&](auto& ar) { tr::write_scalar(ar, "step", std::int64_t{1}); });
  const auto before = read_bytes(path);

  // The fill throws half-way: nothing on disk changes.
  CHECK_THROWS_WITH(tr::write_checkpoint(path, [&](auto& ar) {
                      tr::write_scalar(ar, "step", std::int64_t{2});
                      throw std::runtime_error("out of memory while saving");
                    }),
                    Contains("out of memory"));
  CHECK(read_bytes(path) == before);
  CHECK_FALSE(fs::exists(path + ".tmp"));

  // A crash after part of the temporary file was written: the stale .tmp is ignored by readers
  // and replaced by the next write.
  write_bytes(path + ".tmp", before.substr(0, before.size() / 2));
  std::int64_t step = 0;
  tr::read_checkpoint(path, [&](auto& ar) { step = tr::read_scalar<std::int64_t>(ar, "step"); });
  CHECK(step == 1);
  tr::write_checkpoint(path, [&](auto& ar) { tr::write_scalar(ar, "step", std::int64_t{3}); });
  tr::read_checkpoint(path, [&](auto& ar) { step = tr::read_scalar<std::int64_t>(ar, "step"); });
  CHECK(step == 3);
  CHECK_FALSE(fs::exists(path + ".tmp"));
}

TEST_CASE("run_directory: names, keep-last-K pruning, the latest complete checkpoint", "[cpu][train]") {
  CHECK(tr::run_directory::step_name(42) == "step-00000042.pt");
  CHECK(tr::run_directory::step_name(123456789) == "step-123456789.pt");
  CHECK(tr::run_directory::parse_step("step-00000042.pt") == 42);
  CHECK(tr::run_directory::parse_step("step-123456789.pt") == 123456789);
  for (const char* bad : {"step-00000042.pt.tmp", "step-.pt", "step-12a.pt", "ckpt.pt", "step-0000000000001.pt"})
    CHECK_FALSE(tr::run_directory::parse_step(bad).has_value());
  CHECK_THROWS_AS(tr::run_directory("x", {.keep = 0}), unirl::config_error);

  temp_dir dir;
  tr::run_directory run(dir.path, {.keep = 3});
  CHECK_FALSE(run.latest().has_value());  // a fresh run
  const auto save = [&](std::int64_t s) {
    return run.save(s, [&](const std::string& p) {
      tr::write_checkpoint(p, [&](auto& ar) { tr::write_scalar(ar, "step", s); });
    });
  };
  for (std::int64_t s = 1; s <= 5; ++s) CHECK(save(s) == dir.path / "checkpoints" / tr::run_directory::step_name(s));
  std::vector<std::int64_t> left;
  for (const auto& e : run.list()) left.push_back(e.step);
  CHECK(left == std::vector<std::int64_t>{3, 4, 5});
  REQUIRE(run.latest().has_value());
  CHECK(run.latest()->step == 5);

  // The newest is truncated (a crash without the atomic rename), the one before has a flipped
  // payload byte (a disk error): both are skipped with a warning, step 3 is the one to resume.
  const auto p5 = (dir.path / "checkpoints" / "step-00000005.pt").string();
  const auto p4 = (dir.path / "checkpoints" / "step-00000004.pt").string();
  write_bytes(p5, read_bytes(p5).substr(0, 40));
  auto b4 = read_bytes(p4);
  b4[b4.size() / 2] = static_cast<char>(b4[b4.size() / 2] ^ 0x55);
  write_bytes(p4, b4);
  // a leftover temporary of an interrupted save is never taken for a checkpoint
  write_bytes((dir.path / "checkpoints" / "step-00000006.pt.tmp").string(), "partial");
  write_bytes((dir.path / "checkpoints" / "notes.tmp").string(), "not ours");
  std::ostringstream warnings;
  auto* old = std::cerr.rdbuf(warnings.rdbuf());
  const auto last = run.latest();
  std::cerr.rdbuf(old);
  REQUIRE(last.has_value());
  CHECK(last->step == 3);
  std::int64_t stored = 0;
  tr::read_checkpoint(last->path.string(), [&](auto& ar) { stored = tr::read_scalar<std::int64_t>(ar, "step"); });
  CHECK(stored == 3);
  CHECK_THAT(warnings.str(), Contains("step-00000005.pt") && Contains("truncated") && Contains("step-00000004.pt") &&
                                 Contains("checksum mismatch") && Contains("falling back"));
  CHECK(run.remove_temporaries() == 1);
  CHECK_FALSE(fs::exists(dir.path / "checkpoints" / "step-00000006.pt.tmp"));
  CHECK(fs::exists(dir.path / "checkpoints" / "notes.tmp"));

  // Resuming from 3 and saving 4 again replaces the damaged file; the (later, damaged) 5 is left
  // until the run overwrites it; then pruning goes on keeping the newest 3.
  save(4);
  CHECK(run.latest()->step == 4);
  save(5);
  save(6);
  left.clear();
  for (const auto& e : run.list()) left.push_back(e.step);
  CHECK(left == std::vector<std::int64_t>{4, 5, 6});
  CHECK(run.latest()->step == 6);
}

// ---------------------------------------------------------------- metrics and progress

TEST_CASE("metrics_writer writes flushed JSON lines", "[cpu][train]") {
  temp_dir dir;
  const auto path = dir / "deep/er/metrics.jsonl";
  {
    tr::metrics_writer w(path);
    REQUIRE(w.is_open());
    unirl::step_stats s;
    s.step = 0;
    s.reward_mean = 0.25;
    s.extra["reward/format"] = 1.0;
    w.write(s.to_json());
    // Flushed: readable before the writer closes.
    const auto rows = tr::read_metrics(path);
    REQUIRE(rows.size() == 1);
    CHECK(rows[0]["reward_mean"] == 0.25);
    CHECK(rows[0]["reward/format"] == 1.0);
    w.write({{"step", 1}, {"kl", std::nan("")}});
  }
  {
    tr::metrics_writer w(path, /*append=*/true);
    w.write({{"step", 2}});
  }
  auto rows = tr::read_metrics(path);
  REQUIRE(rows.size() == 3);
  CHECK(rows[1]["kl"].is_null());
  CHECK(rows[2]["step"] == 2);
  tr::metrics_writer w(path);  // truncates
  w.write({{"step", 0}});
  CHECK(tr::read_metrics(path).size() == 1);

  tr::metrics_writer closed;
  CHECK_FALSE(closed.is_open());
  closed.write({{"x", 1}});  // no-op
  write_bytes(dir / "broken.jsonl", "{\"a\": 1}\n{oops\n");
  CHECK_THAT(error_of([&] { tr::read_metrics(dir / "broken.jsonl"); }), Contains("line 2"));
}

TEST_CASE("progress_line: plain lines off a terminal, one redrawn line on it", "[cpu][train]") {
  CHECK(tr::detail::duration_text(12) == "12s");
  CHECK(tr::detail::duration_text(65) == "1m05s");
  CHECK(tr::detail::duration_text(3720) == "1h02m");

  unirl::step_stats s;
  s.reward_mean = 0.5;
  s.kl = 0.01;
  s.loss = -0.125;
  s.samples_per_second = 64.0;
  s.seconds = 2.0;
  {
    std::ostringstream os;
    tr::progress_line p(20, true, os, /*terminal=*/false);
    for (int i = 0; i < 20; ++i) {
      s.step = i;
      p.update(s);
    }
    p.finish();
    const auto out = os.str();
    CHECK(out.find('\r') == std::string::npos);
    // The first step, then every 2 steps (10% of 20): 1, 2, 4, ..., 20.
    CHECK(std::count(out.begin(), out.end(), '\n') == 11);
    CHECK_THAT(out, Contains("step 10/20  reward 0.5  kl 0.01  loss -0.125  64.0 samples/s  ETA 20s\n"));
    CHECK_THAT(out, Contains("step 20/20") && Contains("ETA 0s"));
    CHECK_THAT(out, !Contains("step 3/20"));
  }
  {
    std::ostringstream os;
    tr::progress_line p(0, true, os, /*terminal=*/true);  // unknown total: no ETA
    s.step = 0;
    s.reward_mean = 123.25;
    p.update(s);
    s.step = 1;
    s.reward_mean = 1;
    p.update(s);
    CHECK(os.str().find('\n') == std::string::npos);
    p.finish();
    const auto out = os.str();
    CHECK(std::count(out.begin(), out.end(), '\r') == 2);
    CHECK(out.back() == '\n');
    CHECK_THAT(out, Contains("\rstep 1  reward 123.2") && Contains("\rstep 2  reward 1  ") && !Contains("ETA"));
    // The second line is padded to cover the first, longer one.
    const auto second = out.substr(out.rfind('\r') + 1);
    CHECK(second.size() - 1 >= out.find('\r', 1) - 1);
  }
  {
    std::ostringstream os;
    tr::progress_line p(5, false, os, true);
    p.update(s);
    p.finish();
    CHECK(os.str().empty());
  }
}

// ---------------------------------------------------------------- plots

#if defined(UNIRL_WITH_STB)
namespace {
struct png {
  int w = 0, h = 0;
  std::vector<unsigned char> rgb;
  explicit png(const std::string& path) {
    int n = 0;
    unsigned char* data = stbi_load(path.c_str(), &w, &h, &n, 3);
    REQUIRE(data != nullptr);
    rgb.assign(data, data + static_cast<std::size_t>(w) * h * 3);
    stbi_image_free(data);
  }
  bool is(int x, int y, const std::array<std::uint8_t, 3>& c) const {
    if (x < 0 || y < 0 || x >= w || y >= h) return false;
    const auto* p = &rgb[(static_cast<std::size_t>(y) * w + x) * 3];
    return p[0] == c[0] && p[1] == c[1] && p[2] == c[2];
  }
  bool near(int x, int y, const std::array<std::uint8_t, 3>& c, int r = 1) const {
    for (int dy = -r; dy <= r; ++dy)
      for (int dx = -r; dx <= r; ++dx)
        if (is(x + dx, y + dy, c)) return true;
    return false;
  }
  int count(const std::array<std::uint8_t, 3>& c, int x0 = 0, int y0 = 0, int x1 = -1, int y1 = -1) const {
    if (x1 < 0) x1 = w;
    if (y1 < 0) y1 = h;
    int n = 0;
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) n += is(x, y, c);
    return n;
  }
};
}  // namespace

TEST_CASE("plot_series draws the curves where their values are", "[cpu][train]") {
  temp_dir dir;
  std::vector<double> x, up, down;
  for (int i = 0; i <= 100; ++i) {
    x.push_back(i);
    up.push_back(i * 0.01);
    down.push_back(1.0 - i * 0.01);
  }
  const std::vector<tr::series> s{{"up", x, up}, {"down", x, down}};
  const auto path = dir / "sub/lines.png";
  tr::plot_series(path, s, "two lines", 500, 300);
  const png img(path);
  REQUIRE(img.w == 500);
  REQUIRE(img.h == 300);
  const auto blue = tr::plot_palette[0], orange = tr::plot_palette[1];
  const auto f = tr::detail::frame_for(s, 0, 0, 500, 300);
  CHECK(f.xmin == 0);
  CHECK(f.xmax == 100);
  CHECK(f.ymin == 0);
  CHECK(f.ymax == 1);
  // "up" rises from the bottom-left to the top-right corner of the plot area, "down" falls.
  for (double t : {0.1, 0.3, 0.7, 0.9}) {
    INFO("t = " << t);
    CHECK(img.near(f.px(100 * t), f.py(t), blue));
    CHECK(img.near(f.px(100 * t), f.py(1 - t), orange));
    CHECK_FALSE(img.near(f.px(100 * t), f.py(1 - t), blue, 0));
  }
  // In the plot area's upper-left quarter only "down" passes.
  CHECK(img.count(orange, f.x, f.y, f.x + f.w / 4, f.y + f.h / 4) > 20);
  CHECK(img.count(blue, f.x, f.y, f.x + f.w / 4, f.y + f.h / 4) == 0);
  // Text was drawn (black pixels in the title band and next to the y axis).
  CHECK(img.count({0, 0, 0}, 0, 0, img.w, f.y) > 50);
  CHECK(img.count({0, 0, 0}, 0, f.y, f.x, f.y + f.h) > 5);

  CHECK_THAT(error_of([&] { tr::plot_series(dir / "x.png", {{"bad", {1, 2}, {1}}}, "t"); }),
             Contains("'bad'") && Contains("2 x values but 1 y values"));
  CHECK_THAT(error_of([&] { tr::plot_series(dir / "x.png", s, "t", 50, 50); }), Contains("50 x 50"));
}

TEST_CASE("plot_metrics stacks one panel per key from metrics.jsonl", "[cpu][train]") {
  temp_dir dir;
  const auto jsonl = dir / "metrics.jsonl";
  {
    tr::metrics_writer w(jsonl);
    for (int i = 0; i < 30; ++i) {
      unirl::step_stats s;
      s.step = i;
      s.reward_mean = i / 30.0;
      s.kl = i == 10 ? std::nan("") : 0.01 * i;
      w.write(s.to_json());
    }
  }
  const auto rows = tr::read_metrics(jsonl);
  const auto kl = tr::metrics_series(rows, "kl");
  REQUIRE(kl.y.size() == 30);
  CHECK(std::isnan(kl.y[10]));
  CHECK(kl.x[29] == 29);

  const auto out = dir / "curves.png";
  tr::plot_metrics(jsonl, out);
  const png img(out);
  CHECK(img.w == 640);
  CHECK(img.h == 480);
  const auto blue = tr::plot_palette[0];
  CHECK(img.count(blue, 0, 0, img.w, 240) > 100);   // reward panel
  CHECK(img.count(blue, 0, 240, img.w, 480) > 100); // kl panel

  CHECK_THAT(error_of([&] { tr::plot_metrics(jsonl, out, {"reward_mean", "nope"}); }),
             Contains("'nope'") && Contains("keys present") && Contains("reward_mean"));
  CHECK_THAT(error_of([&] { tr::plot_metrics(dir / "none.jsonl", out); }), Contains("none.jsonl"));
}
#else
TEST_CASE("plots without stb fail with a clear message", "[cpu][train]") {
  CHECK_THAT(error_of([] { tr::plot_series("x.png", {{"a", {0, 1}, {0, 1}}}, "t"); }), Contains("without stb"));
}
#endif

TEST_CASE("loss_scaler: backoff on a non-finite step, growth after growth_interval good ones, exact unscale, "
          "state round trip",
          "[cpu][train][precision]") {
  unirl::train::loss_scaler s({.init_scale = 1024.0, .growth_factor = 2.0, .backoff_factor = 0.5,
                               .growth_interval = 3, .min_scale = 128.0});
  // scale(): loss * 1024; unscale(): gradients / 1024 (powers of two: exact).
  auto w = torch::tensor({0.3f, -1.7f}, torch::requires_grad());
  s.scale((w * w).sum()).backward();
  s.unscale({w});
  CHECK(torch::equal(w.grad(), torch::tensor({0.6f, -3.4f})));
  CHECK(s.update(false) == 512.0);   // overflow: halved, count restarted
  CHECK(s.update(true) == 512.0);
  CHECK(s.update(true) == 512.0);
  CHECK(s.good_steps() == 2);
  CHECK(s.update(false) == 256.0);   // a non-finite step restarts the count
  CHECK(s.good_steps() == 0);
  CHECK(s.update(true) == 256.0);
  CHECK(s.update(true) == 256.0);
  CHECK(s.update(true) == 512.0);    // third good step in a row: doubled
  CHECK(s.good_steps() == 0);
  CHECK(s.update(false) == 256.0);
  CHECK(s.update(false) == 128.0);
  CHECK(s.update(false) == 128.0);   // never below min_scale
  s.update(true);
  torch::serialize::OutputArchive out;
  s.save(out);
  std::stringstream buf;
  out.save_to(buf);
  torch::serialize::InputArchive in;
  in.load_from(buf);
  unirl::train::loss_scaler r({.init_scale = 1.0, .min_scale = 1.0});
  r.load(in);
  CHECK(r.value() == 128.0);
  CHECK(r.good_steps() == 1);
  CHECK_THROWS_WITH(unirl::train::loss_scaler({.backoff_factor = 1.5}),
                    Catch::Contains("loss_scale.backoff_factor") && Catch::Contains("(0, 1)"));
}
