// Local rewards: rule scorers, the weighted composer (static and adaptive weights), embedding
// alignment, learned reward models (torch::nn and TorchScript, multi-scale / multi-crop), and the
// evaluation metrics BLEU and SSIM against published reference values.
#include <catch2/catch.hpp>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/reward.hpp>
#include <unirl/data/canvas.hpp>
#include <unirl/eval/bleu.hpp>
#include <unirl/eval/ssim.hpp>
#include <unirl/models/vlm/vision_cache.hpp>
#include <unirl/rewards/actions.hpp>
#include <unirl/rewards/alignment.hpp>
#include <unirl/rewards/clip.hpp>
#include <unirl/rewards/consistency.hpp>
#include <unirl/rewards/model.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/token.hpp>

#include <common/digits.hpp>

#include "test_batches.hpp"

#if UNIRL_HAS_STB  // an independent PNG reader for save_canvas_grid's output
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
#include <stb_image.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#endif

using namespace unirl::rewards;
using rewards_test::fixed_scorer;
using rewards_test::image_batch;
using rewards_test::text_batch;

namespace {
std::vector<float> values(const torch::Tensor& t) {
  auto c = t.to(torch::kCPU).to(torch::kFloat32).contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

std::filesystem::path make_temp_dir(const std::string& stem) {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() / (stem + "-" + std::to_string(rd()) + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir;
}
}  // namespace

// Scorers fit the batches that carry their fields, and only those.
static_assert(ScorerFor<exact_answer, text_batch>);
static_assert(ScorerFor<regex_format, text_batch>);
static_assert(ScorerFor<overlong_penalty, text_batch>);
static_assert(ScorerFor<iou_reward, text_batch>);
static_assert(ScorerFor<bleu_reward, text_batch>);
static_assert(!ScorerFor<exact_answer, image_batch>);
static_assert(!ScorerFor<regex_format, image_batch>);
static_assert(ScorerFor<exact_answer, unirl::token_rollout>);
static_assert(ScorerFor<overlong_penalty, unirl::token_rollout>);
static_assert(unirl::RewardFor<weighted<exact_answer, regex_format>, text_batch>);
static_assert(unirl::RewardFor<weighted<exact_answer, regex_format>, unirl::token_rollout>);
static_assert(unirl::ReportsComponents<weighted<exact_answer, regex_format>>);
// A composite that holds a scorer which cannot read the batch is not a reward for it (the trainer's
// RewardFor check rejects it; calling it directly names ScorerFor — see weighted_misfit.cpp).
static_assert(!unirl::RewardFor<weighted<exact_answer, regex_format>, image_batch>);
static_assert(!unirl::RewardFor<weighted<regex_format>, unirl::flow_rollout>);
static_assert(HasImages<unirl::flow_rollout>);
static_assert(HasImages<image_batch> && !HasImages<text_batch>);

TEST_CASE("exact_answer compares the extracted answer with the reference", "[cpu][rewards]") {
  text_batch b{.completions = {"12+30=42", "12+30=41", " 42 ", "no answer"}, .references = {"42", "42", "42", "42"}};
  SECTION("whole completion, trimmed") {
    exact_answer e;
    CHECK(values(e(b)) == std::vector<float>{0, 0, 1, 0});
  }
  SECTION("last match of a regex, compared as numbers") {
    exact_answer e{{.extract = R"(=\s*(-?[0-9.]+))", .numeric = true}};
    text_batch c{.completions = {"1=2 then =42", "=42.0000001", "=41", "nothing"}, .references = {"42", "42", "42", "42"}};
    CHECK(values(e(c)) == std::vector<float>{1, 1, 0, 0});
  }
  SECTION("case-insensitive, custom values") {
    exact_answer e{{.case_sensitive = false, .correct = 2.0, .wrong = -1.0}};
    text_batch c{.completions = {"Paris", "paris ", "Lyon"}, .references = {"PARIS", "Paris", "Paris"}};
    CHECK(values(e(c)) == std::vector<float>{2, 2, -1});
  }
  SECTION("errors name the problem") {
    text_batch c{.completions = {"a", "b"}, .references = {"a"}};
    CHECK_THROWS_WITH(exact_answer{}(c), Catch::Contains("1 references for 2 samples"));
    CHECK_THROWS_AS(exact_answer({.extract = "(unclosed"}), unirl::config_error);
    CHECK_THROWS_WITH(exact_answer({.extract = "(unclosed"}), Catch::Contains("extract") && Catch::Contains("(unclosed"));
  }
}

TEST_CASE("regex_format matches whole completions or anywhere", "[cpu][rewards]") {
  text_batch b{.completions = {"<think>x</think> 42", "42", "<think></think>"}};
  regex_format full{{.pattern = R"(<think>.*</think>\s*\d+)"}};
  CHECK(values(full(b)) == std::vector<float>{1, 0, 0});
  regex_format any{{.pattern = R"(\d+)", .full_match = false, .matched = 0.5, .unmatched = -0.5}};
  CHECK(values(any(b)) == std::vector<float>{0.5f, 0.5f, -0.5f});
  CHECK_THROWS_WITH(regex_format({.pattern = "[a-"}), Catch::Contains("pattern") && Catch::Contains("[a-"));
}

TEST_CASE("regex rewards run RE2: long completions in linear time, patterns RE2 refuses are named", "[cpu][rewards]") {
  // Before: std::regex recursed once per character and a completion of ~30 000 characters
  // overflowed the stack (SIGSEGV). Hand values: only the first and third have the format.
  const std::string digits(1000000, '7');
  text_batch b{.completions = {"1+1=" + digits, std::string(300000, 'x'), "12+30=42", "1+1=" + digits + "x"}};
  regex_format fmt{{.pattern = R"(\s*-?\d+\s*[-+*]\s*-?\d+\s*=\s*-?\d+\s*)"}};
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(values(fmt(b)) == std::vector<float>{1, 0, 1, 0});
  regex_format anywhere{{.pattern = R"(x$)", .full_match = false}};
  CHECK(values(anywhere(b)) == std::vector<float>{0, 1, 0, 1});
  // The last match of the extraction, far into a long text; numbers of a long text.
  exact_answer last{{.extract = R"(=\s*(\d+))"}};
  text_batch e{.completions = {std::string(200000, '=') + "= 5 then =" + std::string(100000, ' ') + "6"}, .references = {"6"}};
  CHECK(values(last(e)) == std::vector<float>{1});
  iou_reward iou;
  text_batch boxes{.completions = {"[0, 0, 10, 10]" + std::string(200000, '1'), std::string(400, '9') + " 1 2 3",
                                   "[0, 0, 5, 10] " + std::string(100000, '.')},
                   .references = {"0 0 10 10", "0 0 10 10", "0 0 10 10"}};
  // A number too large for a double makes no box: the completion gets `invalid` (0), not a NaN.
  CHECK(values(iou(boxes)) == std::vector<float>{1, 0, 0.5f});
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);

  // RE2 has no backreferences or lookaround: refused, naming the option and the pattern.
  CHECK_THROWS_AS(regex_format({.pattern = R"((a)\1)"}), unirl::config_error);
  CHECK_THROWS_WITH(regex_format({.pattern = R"((a)\1)"}),
                    Catch::Contains("pattern") && Catch::Contains(R"('(a)\1')") && Catch::Contains("backreferences"));
  CHECK_THROWS_WITH(regex_format({.pattern = "(?=x)x"}), Catch::Contains("'(?=x)x'") && Catch::Contains("lookaround"));
  CHECK_THROWS_WITH(exact_answer({.extract = R"((?<!-)\d+)"}), Catch::Contains("extract") && Catch::Contains(R"('(?<!-)\d+')"));
  // UTF-8: '.' is one character.
  regex_format three{{.pattern = "^.{3}$"}};
  text_batch u{.completions = {"h\xc3\xa9!", "abcd"}};
  CHECK(values(three(u)) == std::vector<float>{1, 0});
}

TEST_CASE("overlong_penalty follows DAPO's soft overlong formula", "[cpu][rewards]") {
  // L_max = 10, L_cache = 4: 0 up to 6; (6 - L) / 4 on (6, 10]; -1 beyond.
  overlong_penalty p{{.max_length = 10, .cache_length = 4}};
  CHECK(p.penalty(0) == 0.0);
  CHECK(p.penalty(6) == 0.0);
  CHECK(p.penalty(7) == Approx(-0.25));
  CHECK(p.penalty(9) == Approx(-0.75));
  CHECK(p.penalty(10) == Approx(-1.0));
  CHECK(p.penalty(11) == -1.0);
  text_batch b{.completions = {"abcdef", "abcdefgh", "abcdefghijklmnop"}};
  CHECK(values(p(b)) == std::vector<float>{0.0f, -0.5f, -1.0f});

  overlong_penalty words{{.max_length = 4, .cache_length = 2, .unit = length_unit::words}};
  text_batch w{.completions = {"one two", "one  two three", " a b c d e "}};
  CHECK(values(words(w)) == std::vector<float>{0.0f, -0.5f, -1.0f});

  // Token lengths come from the token track's lengths().
  unirl::token_rollout t;
  t.completion_ids = torch::zeros({3, 12}, torch::kInt64);
  t.completion_mask = torch::zeros({3, 12});
  t.completion_mask.index_put_({0, torch::indexing::Slice(0, 5)}, 1);
  t.completion_mask.index_put_({1, torch::indexing::Slice(0, 8)}, 1);
  t.completion_mask.index_put_({2, torch::indexing::Slice(0, 12)}, 1);
  overlong_penalty tokens{{.max_length = 10, .cache_length = 4, .unit = length_unit::tokens}};
  CHECK(values(tokens(t)) == std::vector<float>{0.0f, -0.5f, -1.0f});
  CHECK_THROWS_WITH(tokens(b), Catch::Contains("completion_lengths"));
  CHECK_THROWS_AS(overlong_penalty({.max_length = 4, .cache_length = 5}), unirl::config_error);
  CHECK_THROWS_WITH(overlong_penalty({.max_length = 4, .cache_length = 5}), Catch::Contains("cache_length") && Catch::Contains("5"));
}

TEST_CASE("IoU of boxes, as a tensor op and as a text reward", "[cpu][rewards]") {
  auto a = torch::tensor({{0., 0., 2., 2.}, {0., 0., 2., 2.}, {0., 0., 1., 1.}, {0., 0., 2., 2.}});
  auto b = torch::tensor({{1., 1., 3., 3.}, {0., 0., 2., 2.}, {2., 2., 3., 3.}, {0., 0., 1., 2.}});
  auto iou = box_iou(a, b);
  CHECK(iou[0].item<double>() == Approx(1.0 / 7.0));  // overlap 1, union 4 + 4 - 1
  CHECK(iou[1].item<double>() == Approx(1.0));
  CHECK(iou[2].item<double>() == 0.0);
  CHECK(iou[3].item<double>() == Approx(0.5));
  CHECK_THROWS_WITH(box_iou(a, b.narrow(1, 0, 3)), Catch::Contains("(N, 4)"));

  text_batch t{.completions = {"the cat is at [0, 0, 2, 2]", "box: 1 1 3 3", "I cannot find it"},
               .references = {"[1, 1, 3, 3]", "[1, 1, 3, 3]", "[0, 0, 1, 1]"}};
  iou_reward r;
  auto s = values(r(t));
  CHECK(s[0] == Approx(1.0 / 7.0));
  CHECK(s[1] == Approx(1.0));
  CHECK(s[2] == 0.0f);
  iou_reward thr{{.threshold = 0.5, .invalid = -1.0}};
  CHECK(values(thr(t)) == std::vector<float>{0.0f, 1.0f, -1.0f});
  // (x, y, w, h): [0,0,2,2] and [1,1,2,2] are the boxes of the first case.
  text_batch w{.completions = {"0 0 2 2"}, .references = {"1 1 2 2"}};
  CHECK(values(iou_reward({.format = box_format::xywh})(w))[0] == Approx(1.0 / 7.0));
  text_batch bad{.completions = {"0 0 2 2"}, .references = {"1 1"}};
  CHECK_THROWS_WITH(r(bad), Catch::Contains("has 2 numbers"));
}

TEST_CASE("BLEU matches NLTK's documented examples", "[cpu][eval][bleu]") {
  using unirl::eval::tokens;
  // The examples of nltk.translate.bleu_score.sentence_bleu / corpus_bleu (NLTK 3.8 docstrings);
  // values printed by NLTK 3.8: 0.5045666840058485 and 0.5920778868801042.
  const tokens hyp1{"It", "is", "a", "guide", "to", "action", "which", "ensures", "that", "the", "military", "always",
                    "obeys", "the", "commands", "of", "the", "party"};
  const tokens ref1a{"It", "is", "a", "guide", "to", "action", "that", "ensures", "that", "the", "military", "will",
                     "forever", "heed", "Party", "commands"};
  const tokens ref1b{"It", "is", "the", "guiding", "principle", "which", "guarantees", "the", "military", "forces",
                     "always", "being", "under", "the", "command", "of", "the", "Party"};
  const tokens ref1c{"It", "is", "the", "practical", "guide", "for", "the", "army", "always", "to", "heed", "the",
                     "directions", "of", "the", "party"};
  const tokens hyp2{"he", "read", "the", "book", "because", "he", "was", "interested", "in", "world", "history"};
  const tokens ref2a{"he", "was", "interested", "in", "world", "history", "because", "he", "read", "the", "book"};
  CHECK(unirl::eval::sentence_bleu(hyp1, {ref1a, ref1b, ref1c}) == Approx(0.5045666840058485).epsilon(1e-12));
  const auto corpus = unirl::eval::corpus_bleu({hyp1, hyp2}, {{ref1a, ref1b, ref1c}, {ref2a}});
  CHECK(corpus.score == Approx(0.5920778868801042).epsilon(1e-12));
  CHECK(corpus.hypothesis_length == 29);
  CHECK(corpus.brevity_penalty == 1.0);

  // Smoothing methods 1-3 of NLTK 3.8 on "the cat sat on the mat" / "the cat is on the mat":
  // p = 5/6, 3/5, 1/4, 0/3 -> unsmoothed 0.
  const std::string h = "the cat sat on the mat", r = "the cat is on the mat";
  using unirl::eval::bleu_smoothing;
  CHECK(unirl::eval::sentence_bleu(h, {r}) == 0.0);
  CHECK(unirl::eval::sentence_bleu(h, {r}, {.smoothing = bleu_smoothing::epsilon}) == Approx(0.25406637407730737).epsilon(1e-12));
  CHECK(unirl::eval::sentence_bleu(h, {r}, {.smoothing = bleu_smoothing::add_one}) == Approx(0.48549177170732344).epsilon(1e-12));
  CHECK(unirl::eval::sentence_bleu(h, {r}, {.smoothing = bleu_smoothing::exponential}) == Approx(0.37991784282579627).epsilon(1e-12));

  // Known cases: identical = 1; a short candidate pays exp(1 - r/c).
  CHECK(unirl::eval::sentence_bleu(r, {r}) == Approx(1.0));
  const auto short_one = unirl::eval::corpus_bleu(std::vector<std::string>{"a b c d e"}, {{"a b c d e f g h i j"}});
  CHECK(short_one.brevity_penalty == Approx(std::exp(1.0 - 10.0 / 5.0)));
  CHECK(short_one.score == Approx(std::exp(1.0 - 10.0 / 5.0)));
  CHECK_THROWS_WITH(unirl::eval::corpus_bleu(std::vector<std::string>{"a"}, {}), Catch::Contains("1 hypotheses but 0"));
  CHECK_THROWS_AS(unirl::eval::sentence_bleu(h, {r}, {.max_order = 0}), unirl::config_error);

  // As a reward: sentence BLEU per sample, several references split on a separator.
  text_batch b{.completions = {h, r}, .references = {r + "|" + h, r}};
  bleu_reward br{{.reference_separator = "|"}};
  CHECK(values(br(b)) == std::vector<float>{1.0f, 1.0f});
  text_batch c{.completions = {h}, .references = {r}};
  CHECK(values(bleu_reward{}(c))[0] == Approx(0.37991784282579627));
}

TEST_CASE("SSIM: Wang et al.'s constants, known cases and scikit-image's value", "[cpu][eval][ssim]") {
  using unirl::eval::ssim;
  auto i = torch::arange(32, torch::kFloat64).view({32, 1}), j = torch::arange(24, torch::kFloat64).view({1, 24});
  auto x = (torch::sin(0.3 * i) * torch::cos(0.2 * j) + 1) / 2;
  auto y = 0.8 * x + 0.1 + 0.05 * torch::sin(0.7 * i * j);
  // Identical images: exactly 1.
  CHECK(ssim(x, x).item<double>() == Approx(1.0).epsilon(1e-12));
  // Constant images a, b: variances and covariance vanish, SSIM = (2ab + C1) / (a^2 + b^2 + C1).
  const double a = 0.3, bb = 0.6, c1 = std::pow(0.01, 2);
  CHECK(ssim(torch::full({16, 16}, a), torch::full({16, 16}, bb)).item<double>() ==
        Approx((2 * a * bb + c1) / (a * a + bb * bb + c1)).epsilon(1e-9));
  // skimage.metrics.structural_similarity(x, y, gaussian_weights=True, sigma=1.5,
  // use_sample_covariance=False, data_range=1.0) with scikit-image 0.19.3 (Wang et al.'s settings).
  CHECK(ssim(x, y).item<double>() == Approx(0.9102840605083301).epsilon(1e-9));
  auto x8 = torch::round(x * 255), y8 = torch::round(y * 255);
  CHECK(ssim(x8, y8, {.data_range = 255}).item<double>() == Approx(0.9101026589946088).epsilon(1e-9));
  // Three channels (channel_axis=0 in skimage): the mean over channels.
  auto z = torch::stack({x, y, 1 - x}), w = torch::stack({y, x, 1 - y});
  CHECK(ssim(z, w).item<double>() == Approx(0.9118790500037793).epsilon(1e-9));
  // Batched (N, C, H, W) gives one value per image; symmetric.
  auto batch = ssim(torch::stack({z, z}), torch::stack({w, z}));
  REQUIRE(batch.sizes() == torch::IntArrayRef{2});
  CHECK(batch[0].item<double>() == Approx(0.9118790500037793).epsilon(1e-9));
  CHECK(batch[1].item<double>() == Approx(1.0));
  CHECK(ssim(y, x).item<double>() == Approx(ssim(x, y).item<double>()));
  CHECK_THROWS_WITH(ssim(torch::zeros({8, 8}), torch::zeros({8, 8})), Catch::Contains("smaller than the 11x11 window"));
  CHECK_THROWS_WITH(ssim(torch::zeros({16, 16}), torch::zeros({16, 17})), Catch::Contains("same shape"));
}

TEST_CASE("weighted composes scorers with run-time weights and reports components", "[cpu][rewards]") {
  text_batch b{.completions = {"=42", "=41", "42", "=7"}, .references = {"42", "42", "42", "7"}};
  using reward_t = weighted<exact_answer, regex_format>;
  reward_t reward{{.weights = {1.0, -0.5}}, exact_answer{{.extract = R"(=?(\d+))"}}, regex_format{{.pattern = R"(=\d+)"}}};
  auto r = values(reward(b));
  // exact: 1, 0, 1, 1; format: 1, 1, 0, 1; total = exact - 0.5 format.
  CHECK(r == std::vector<float>{0.5f, -0.5f, 1.0f, 0.5f});
  auto comps = reward.last_components();
  CHECK(comps.at("exact_answer") == Approx(0.75));
  CHECK(comps.at("format") == Approx(0.75));
  CHECK(comps.at("exact_answer/std") == Approx(std::sqrt(0.75 * 0.25)));
  CHECK(reward.names() == std::vector<std::string>{"exact_answer", "format"});
  CHECK(values(reward.last_scores()[1]) == std::vector<float>{1, 1, 0, 1});

  // Default weights are 1; names can be overridden; works on the token track's batch.
  weighted<exact_answer, regex_format> plain{{.names = {"correct", "fmt"}}, exact_answer{}, regex_format{{.pattern = ".*"}}};
  unirl::token_rollout t;
  t.completion_ids = torch::zeros({2, 3}, torch::kInt64);
  t.completions = {"5", "6"};
  t.references = {"5", "5"};
  CHECK(values(plain(t)) == std::vector<float>{2.0f, 1.0f});
  CHECK(plain.last_components().count("correct") == 1);
  // A token batch without decoded text is reported, not scored as zeros.
  t.completions.clear();
  CHECK_THROWS_WITH(plain(t), Catch::Contains("0 completion texts for 2 samples"));

  // Bad options and bad component outputs are named.
  CHECK_THROWS_WITH((reward_t{{.weights = {1.0}}, exact_answer{}, regex_format{}}), Catch::Contains("weights") && Catch::Contains("expected 2"));
  CHECK_THROWS_AS((reward_t{{.weights = {1.0, NAN}}, exact_answer{}, regex_format{}}), unirl::config_error);
  weighted<fixed_scorer> wrong{fixed_scorer{torch::ones({3}), "three"}};
  CHECK_THROWS_WITH(wrong(b), Catch::Contains("'three'") && Catch::Contains("expected (4,)"));
  weighted<fixed_scorer> nan{fixed_scorer{torch::tensor({1.f, NAN, 0.f, 0.f}), "nan"}};
  CHECK_THROWS_WITH(nan(b), Catch::Contains("'nan'") && Catch::Contains("non-finite"));
}

TEST_CASE("adaptive weights follow the components' spread and stay normalised", "[cpu][rewards]") {
  text_batch b{.completions = {"a", "b", "c", "d"}};
  // Component a: std 1 (values +-1); component b: std 10; component c: constant.
  auto ca = torch::tensor({1.f, -1.f, 1.f, -1.f}), cb = torch::tensor({10.f, -10.f, -10.f, 10.f}),
       cc = torch::full({4}, 3.f);
  weighted<fixed_scorer, fixed_scorer, fixed_scorer> w{{.weights = {1.0, 1.0, 0.5}, .adaptive = true, .adaptive_momentum = 0.5},
                                                       fixed_scorer{ca, "a"}, fixed_scorer{cb, "b"}, fixed_scorer{cc, "c"}};
  auto r = w(b);
  // First batch sets the spreads s = (1, 10, 0). w_i = b_i / s_i rescaled so |w_a| + |w_b| = 2;
  // the constant component keeps its base weight 0.5.
  const double wa = 2.0 * 1.0 / 1.1, wb = 2.0 * 0.1 / 1.1;
  CHECK(w.weights()[0] == Approx(wa));
  CHECK(w.weights()[1] == Approx(wb));
  CHECK(w.weights()[2] == Approx(0.5));
  CHECK(w.last_components().at("b/weight") == Approx(wb));
  for (int k = 0; k < 4; ++k)
    CHECK(r[k].item<double>() == Approx(wa * ca[k].item<double>() + wb * cb[k].item<double>() + 0.5 * 3.0).epsilon(1e-5));
  // Second batch: b's spread drops to 2 -> EMA 0.5 * 10 + 0.5 * 2 = 6.
  w.get<1>().values = torch::tensor({2.f, -2.f, 2.f, -2.f});
  w(b);
  const double sa = 1.0, sb = 6.0;
  CHECK(w.weights()[0] == Approx(2.0 * (1 / sa) / (1 / sa + 1 / sb)));
  CHECK(w.weights()[1] == Approx(2.0 * (1 / sb) / (1 / sa + 1 / sb)));
  // Negative base weights keep their sign.
  weighted<fixed_scorer, fixed_scorer> neg{{.weights = {1.0, -1.0}, .adaptive = true}, fixed_scorer{ca, "a"}, fixed_scorer{cb, "b"}};
  neg(b);
  CHECK(neg.weights()[0] > 0);
  CHECK(neg.weights()[1] < 0);
  CHECK(std::abs(neg.weights()[0]) + std::abs(neg.weights()[1]) == Approx(2.0));
}

TEST_CASE("embedding_alignment is the cosine of two encoders' outputs", "[cpu][rewards]") {
  text_batch b{.completions = {"x", "y", "z"}};
  auto img = [](const text_batch&) { return torch::tensor({{1.f, 0.f}, {1.f, 0.f}, {0.f, 3.f}}); };
  auto txt = [](const text_batch&) { return torch::tensor({{2.f, 2.f}, {-1.f, 0.f}, {0.f, 0.5f}}); };
  embedding_alignment align{img, txt};
  auto r = values(align(b));
  CHECK(r[0] == Approx(1.0 / std::sqrt(2.0)));
  CHECK(r[1] == Approx(-1.0));
  CHECK(r[2] == Approx(1.0));
  embedding_alignment clip{img, txt, {.scale = 2.5, .clamp_negative = true}};
  CHECK(values(clip(b)) == std::vector<float>{static_cast<float>(2.5 / std::sqrt(2.0)), 0.0f, 2.5f});
  auto narrow = [](const text_batch&) { return torch::ones({3, 3}); };
  embedding_alignment bad{img, narrow};
  CHECK_THROWS_WITH(bad(b), Catch::Contains("[3, 2]") && Catch::Contains("[3, 3]"));
}

namespace {
// Score = 2 * mean pixel, or the top-left pixel: simple enough to check views by hand.
struct pixel_net_impl : torch::nn::Module {
  bool corner = false;
  explicit pixel_net_impl(bool c = false) : corner(c) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return corner ? x.index({torch::indexing::Slice(), 0, 0, 0}) : 2 * x.mean({1, 2, 3});
  }
};
struct pixel_net : torch::nn::ModuleHolder<pixel_net_impl> {
  using ModuleHolder::ModuleHolder;
  explicit pixel_net(bool corner) : ModuleHolder(std::make_shared<pixel_net_impl>(corner)) {}
};

struct logits_net_impl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    auto m = x.mean({1, 2, 3});
    return torch::stack({m, 2 * m, -m}, 1);  // (B, 3)
  }
};
struct logits_net : torch::nn::ModuleHolder<logits_net_impl> {
  using ModuleHolder::ModuleHolder;
  logits_net() : ModuleHolder(std::make_shared<logits_net_impl>()) {}
};
}  // namespace

TEST_CASE("learned_reward scores views of images with a torch::nn module", "[cpu][rewards]") {
  auto imgs = torch::arange(2 * 1 * 8 * 8, torch::kFloat32).view({2, 1, 8, 8}) / 128.0;
  image_batch b{imgs};
  learned_reward plain{pixel_net(false)};
  auto r = plain(b);
  CHECK(torch::allclose(r, 2 * imgs.mean({1, 2, 3})));

  // Views: original, scale 0.5 down-up, centre crop + 4 corners (7 views).
  learned_reward_options o{.scales = {0.5}, .crops = 5, .crop_fraction = 0.75};
  std::int64_t v = 0;
  auto views = image_views(imgs, o, &v);
  CHECK(v == 7);
  CHECK(views.sizes() == torch::IntArrayRef{14, 1, 8, 8});
  namespace F = torch::nn::functional;
  auto up = [](const torch::Tensor& t) {
    return F::interpolate(t, F::InterpolateFuncOptions().size(std::vector<std::int64_t>{8, 8}).mode(torch::kBilinear).align_corners(false));
  };
  // Corner views: 6x6 crops resized to 8x8; the bottom-right one starts at (2, 2).
  CHECK(torch::allclose(views.narrow(0, 12, 2), up(imgs.narrow(2, 2, 6).narrow(3, 2, 6))));
  CHECK(torch::allclose(views.narrow(0, 4, 2), up(imgs.narrow(2, 1, 6).narrow(3, 1, 6))));  // centre

  // min over views of the top-left pixel: the minimum of each view's corner value.
  learned_reward robust{pixel_net(true), images_input{}, {.scales = {0.5}, .crops = 5, .crop_fraction = 0.75, .aggregate = view_aggregate::min}};
  auto rmin = robust(b);
  auto corners = views.index({torch::indexing::Slice(), 0, 0, 0}).view({7, 2});
  CHECK(torch::allclose(rmin, std::get<0>(corners.min(0))));
  learned_reward mean_views{pixel_net(true), images_input{}, {.scales = {0.5}, .crops = 5, .crop_fraction = 0.75}};
  CHECK(torch::allclose(mean_views(b), corners.mean(0)));
  // A constant image looks the same in every view.
  image_batch flat{torch::full({3, 1, 8, 8}, 0.25f)};
  CHECK(torch::allclose(robust(flat), torch::full({3}, 0.25f)));

  // (B, K) outputs: softmax, then one column; chunked forwards give the same result.
  learned_reward cls{logits_net(), images_input{}, {.activation = output_activation::softmax, .output_index = 1, .chunk_size = 1}};
  CHECK(torch::allclose(cls(b), torch::softmax(logits_net()(imgs), 1).select(1, 1)));
  learned_reward no_col{logits_net()};
  CHECK_THROWS_WITH(no_col(b), Catch::Contains("output_index"));
  CHECK_THROWS_WITH((learned_reward{logits_net(), images_input{}, {.output_index = 5}}(b)), Catch::Contains("output_index = 5"));
  CHECK_THROWS_AS((learned_reward{pixel_net(), images_input{}, {.crops = 7}}), unirl::config_error);

  // The flow track's batch: images are the trajectory's last state.
  unirl::flow_rollout fr;
  fr.trajectory = torch::stack({torch::zeros_like(imgs), imgs}, 1);  // (B, K+1, C, H, W), K = 1
  CHECK(torch::allclose(plain(fr), 2 * imgs.mean({1, 2, 3})));
}

TEST_CASE("learned_reward loads a TorchScript reward model", "[cpu][rewards]") {
  const auto dir = make_temp_dir("unirl-rewards-ts");
  const auto model = (dir / "rm.pt").string();
  const auto script = (dir / "make.py").string();
  {
    std::ofstream py(script);
    py << "import sys, torch\n"
          "class M(torch.nn.Module):\n"
          "    def __init__(self):\n"
          "        super().__init__()\n"
          "        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))\n"
          "    def forward(self, x: torch.Tensor) -> torch.Tensor:\n"
          "        return (x.flatten(1)[:, :3] * self.w).sum(1)\n"
          "torch.jit.script(M()).save(sys.argv[1])\n";
  }
  const std::string cmd = "/usr/bin/python3 " + script + " " + model + " > /dev/null 2>&1";
  if (std::system(cmd.c_str()) != 0 || !std::filesystem::exists(model)) {
    WARN("skipped: /usr/bin/python3 with torch is not available to script a test model");
    std::filesystem::remove_all(dir);
    return;
  }
  auto imgs = torch::randn({4, 1, 4, 4});
  learned_reward rm{torchscript_model(model), images_input{}};
  auto flat = imgs.flatten(1);
  auto expected = 0.5 * flat.select(1, 0) - flat.select(1, 1) + 2.0 * flat.select(1, 2);
  CHECK(torch::allclose(rm(image_batch{imgs}), expected, 1e-5, 1e-6));
  CHECK_THROWS_AS(torchscript_model((dir / "missing.pt").string()), unirl::runtime_failure);
  CHECK_THROWS_WITH(torchscript_model((dir / "missing.pt").string()), Catch::Contains("missing.pt"));
  std::filesystem::remove_all(dir);
}

// ---- Vision-language tasks: canvases of real digits, box text, agent actions -------------------

namespace {
const examples::digits& real_digits() {
  static const auto d = examples::load_digits(std::string(UNIRL_TEST_DATA_DIR) + "/digits.csv.gz");
  return d;
}
}  // namespace

static_assert(ScorerFor<click_reward, text_batch>);
static_assert(unirl::ReportsComponents<click_reward>);
static_assert(!ScorerFor<click_reward, image_batch>);
static_assert(unirl::options::reflects_every_member<click_reward_options>);
static_assert(unirl::options::reflects_every_member<unirl::data::canvas_options>);
static_assert(unirl::options::reflects_every_member<unirl::data::canvas_grid_options>);

TEST_CASE("digit_canvas places real digits without overlap, reproducibly, with their labels and boxes",
          "[cpu][rewards][vlm]") {
  const auto& d = real_digits();
  REQUIRE(d.images.size(0) == 1797);
  unirl::data::digit_canvas make(d.images, d.labels, {.size = 48, .min_digits = 1, .max_digits = 3, .max_scale = 2});
  std::vector<int> counts(4, 0), scales(3, 0);
  for (std::uint64_t seed = 0; seed < 300; ++seed) {
    const auto c = make(seed);
    REQUIRE(c.image.sizes() == torch::IntArrayRef({1, 48, 48}));
    const auto k = c.labels.size();
    REQUIRE((k >= 1 && k <= 3 && c.boxes.size() == k && c.sources.size() == k));
    ++counts[k];
    auto covered = torch::zeros({48, 48}, torch::kBool);
    for (std::size_t i = 0; i < k; ++i) {
      const auto& b = c.boxes[i];
      const auto side = b.width();
      REQUIRE((b.height() == side && (side == 8 || side == 16)));
      ++scales[static_cast<std::size_t>(side / 8)];
      REQUIRE((b.x1 >= 0 && b.y1 >= 0 && b.x2 <= 48 && b.y2 <= 48));
      for (std::size_t j = 0; j < i; ++j) {  // no shared pixel with an earlier digit
        const auto& o = c.boxes[j];
        CHECK((b.x2 <= o.x1 || o.x2 <= b.x1 || b.y2 <= o.y1 || o.y2 <= b.y1));
        CHECK(c.labels[i] != c.labels[j]);  // distinct_labels
      }
      // The label is the data set's, and the box holds that very image, nearest-neighbour scaled.
      const auto src = c.sources[i];
      CHECK(c.labels[i] == d.labels[src].item<std::int64_t>());
      const auto s = side / 8;
      const auto img = c.image.accessor<float, 3>();
      const torch::Tensor digit_image = d.images[src][0];
      const auto digit = digit_image.accessor<float, 2>();
      for (std::int64_t y = 0; y < side; ++y)
        for (std::int64_t x = 0; x < side; ++x) REQUIRE(img[0][b.y1 + y][b.x1 + x] == digit[y / s][x / s]);
      covered.slice(0, b.y1, b.y2).slice(1, b.x1, b.x2).fill_(true);
    }
    CHECK(c.image[0].masked_select(covered.logical_not()).abs().sum().item<float>() == 0.0f);  // blank elsewhere
  }
  CHECK(counts[1] > 50);
  CHECK(counts[2] > 50);
  CHECK(counts[3] > 50);
  CHECK(scales[1] > 50);
  CHECK(scales[2] > 50);
  // The same seed draws the same canvas; another seed another one.
  const auto a = make(17), b = make(17), c = make(18);
  CHECK(torch::equal(a.image, b.image));
  CHECK(a.boxes == b.boxes);
  CHECK(a.labels == b.labels);
  CHECK(!(torch::equal(a.image, c.image) && a.boxes == c.boxes));
  // A single digit for VQA: the image alone, scaled, with its label.
  const auto one = make.digit(5, 2);
  CHECK(one.image.sizes() == torch::IntArrayRef({1, 16, 16}));
  CHECK(one.labels == std::vector<std::int64_t>{d.labels[5].item<std::int64_t>()});
  CHECK(one.boxes == std::vector<unirl::data::pixel_box>{{0, 0, 16, 16}});
  CHECK(one.image[0][15][15].item<float>() == d.images[5][0][7][7].item<float>());
  CHECK(make.single(3).image.size(1) % 8 == 0);
  // Bad settings and inputs are refused, naming the value.
  CHECK_THROWS_WITH(unirl::data::digit_canvas(d.images, d.labels, {.size = 16, .max_digits = 3, .max_scale = 2}),
                    Catch::Contains("size"));
  CHECK_THROWS_WITH(unirl::data::digit_canvas(d.images, d.labels.slice(0, 0, 5)), Catch::Contains("one integer label"));
  CHECK_THROWS_WITH(make.digit(1797), Catch::Contains("index = 1797"));
}

TEST_CASE("box_text writes canvas boxes as iou_reward reads them", "[cpu][rewards][vlm]") {
  const auto& d = real_digits();
  unirl::data::digit_canvas make(d.images, d.labels, {.size = 32, .min_digits = 2, .max_digits = 3});
  const auto c = make(5);
  const auto& b = c.boxes[0];
  using unirl::data::box_style;
  CHECK(unirl::data::box_text({3, 10, 11, 18}) == "[3, 10, 11, 18]");
  CHECK(unirl::data::box_text({3, 10, 11, 18}, box_style::corners) == "(3,10),(11,18)");
  // The reference is the canvas box; answers in either style. A box shifted by 4 pixels along x
  // overlaps 4 x 8 = 32 pixels of a union of 64 + 64 - 32 = 96: IoU 1/3.
  const auto ref = unirl::data::box_text(b);
  const unirl::data::pixel_box shifted{b.x1 + 4, b.y1, b.x2 + 4, b.y2};
  text_batch batch{.completions = {"It is at " + unirl::data::box_text(b, box_style::corners),
                                   unirl::data::box_text(b),
                                   "box: " + unirl::data::box_text(shifted, box_style::corners),
                                   unirl::data::box_text(c.boxes[1]),
                                   "somewhere",
                                   "The " + std::to_string(c.labels[0]) + " is at " + unirl::data::box_text(b)},
                   .references = {ref, ref, ref, ref, ref, ref}};
  const auto r = values(iou_reward{}(batch));
  CHECK(r[0] == Approx(1.0));
  CHECK(r[1] == Approx(1.0));
  CHECK(r[2] == Approx(1.0 / 3.0));
  CHECK(r[3] == 0.0f);  // another digit: no overlap
  CHECK(r[4] == 0.0f);
  // iou_reward reads the FIRST four numbers: an answer that names the digit before the box is
  // read as the box (label, x1, y1, x2) — the task's answer format must be the box alone.
  CHECK(r[5] < 0.5f);
}

TEST_CASE("parse_action reads click / scroll / type / navigate and refuses malformed text with a reason", "[cpu][rewards][vlm]") {
  auto a = parse_action("click(12, 30)");
  REQUIRE(a);
  CHECK(a.action->type == action_type::click);
  CHECK(a.action->x == 12.0);
  CHECK(a.action->y == 30.0);
  a = parse_action("  Click ( 12.5 ,\t-3 )\n");
  REQUIRE(a);
  CHECK((a.action->x == 12.5 && a.action->y == -3.0));
  a = parse_action("scroll(12, 30, down)");
  REQUIRE(a);
  CHECK((a.action->type == action_type::scroll && a.action->dx == 0.0 && a.action->dy == 1.0));
  a = parse_action("scroll(1, 2, LEFT)");
  REQUIRE(a);
  CHECK((a.action->dx == -1.0 && a.action->dy == 0.0));
  a = parse_action("scroll(1, 2, 0, -4.5)");
  REQUIRE(a);
  CHECK((a.action->dx == 0.0 && a.action->dy == -4.5));
  a = parse_action(R"(type(12, 30, "7"))");
  REQUIRE(a);
  CHECK((a.action->type == action_type::type && a.action->text == "7"));
  a = parse_action(R"(type(0, 0, "say \"hi\"\\\n"))");
  REQUIRE(a);
  CHECK(a.action->text == "say \"hi\"\\\n");
  CHECK(to_string(*a.action) == R"(type(0, 0, "say \"hi\"\\\n"))");
  // Seed 003's short forms for a page agent: scroll(dy), type("text") into the focused field,
  // navigate(page) with a bare or quoted page name; each reads back from its canonical form.
  a = parse_action("scroll(-2)");
  REQUIRE(a);
  CHECK((a.action->type == action_type::scroll && a.action->x == 0.0 && a.action->dx == 0.0 && a.action->dy == -2.0));
  CHECK(to_string(*a.action) == "scroll(0, 0, 0, -2)");
  a = parse_action(R"(type( "42" ))");
  REQUIRE(a);
  CHECK((a.action->type == action_type::type && a.action->text == "42" && a.action->x == 0.0));
  a = parse_action("Navigate( shop/cart )");
  REQUIRE(a);
  CHECK((a.action->type == action_type::navigate && a.action->text == "shop/cart"));
  CHECK(to_string(*a.action) == R"(navigate("shop/cart"))");
  a = parse_action(R"(navigate("my \"home\""))");
  REQUIRE(a);
  CHECK(a.action->text == "my \"home\"");
  REQUIRE(parse_action(to_string(*a.action)));
  CHECK(parse_action(to_string(*a.action)).action->text == a.action->text);
  // Malformed: each refused with the reason and where.
  const std::vector<std::pair<std::string, std::string>> bad{
      {"", "expected an action name"},
      {"clik(1, 2)", "expected an action name"},
      {"clicked(1, 2)", "expected an action name"},
      {"click 1, 2", "expected '('"},
      {"click(12, 30", "expected ')'"},
      {"click(12 30)", "expected ','"},
      {"click(nan, 1)", "expected a number"},
      {"click(inf, 1)", "expected a number"},
      {"click(1e400, 1)", "malformed number"},
      {"click(0x1F, 1)", "malformed number"},
      {"click(1.2.3, 4)", "malformed number"},
      {"click(99999999999, 1)", "beyond"},
      {"click(" + std::string(40, '1') + ", 1)", "a number of 40 characters"},
      {"click((1, 2))", "expected a number"},
      {"click(click(1, 2), 3)", "expected a number"},
      {"click(1, 2) and more", "unexpected text after the action"},
      {"scroll(1, 2, sideways)", "expected a number"},
      {"scroll(1, 2)", "expected ','"},
      {"scroll()", "expected a number"},
      {"navigate()", "expected a page name"},
      {"navigate(shop page)", "expected ')'"},
      {"navigate(" + std::string(80, 'p') + ")", "page name is longer than 64 bytes"},
      {"navigate(1, 2)", "expected ')'"},
      {"type(\"a\", 1)", "expected ')'"},
      {R"(type(1, 2, "abc))", "unterminated text"},
      {R"(type(1, 2, "a\qb"))", "unknown escape"},
      {"type(1, 2, \"a\x01\")", "control byte"},
      {R"(type(1, 2, ")" + std::string(100, 'x') + R"("))", "longer than 64 bytes"},
      {"click(1, 2)" + std::string(400, ' '), "bytes long"},
      {std::string(1 << 20, '('), "bytes long"}};
  for (const auto& [text, why] : bad) {
    INFO(text.substr(0, 60));
    const auto r = parse_action(text);
    CHECK_FALSE(r);
    CHECK_THAT(r.error, Catch::Contains(why));
  }
  CHECK(parse_action("click(12,  30").position == 13);
  // Limits are settings.
  CHECK_FALSE(parse_action("click(120, 3)", {.max_coordinate = 100}));
  CHECK(parse_action("click(100, 3)", {.max_coordinate = 100}));
  // find_action: the first action written in prose; positions are byte offsets of the text.
  auto f = find_action("The 7 is top left, so I click(12, 30). Then scroll(1, 2, up).");
  REQUIRE(f);
  CHECK((f.action->type == action_type::click && f.action->x == 12.0 && f.position == 24));
  f = find_action("First, navigate(shop). Then click.");
  REQUIRE(f);
  CHECK((f.action->type == action_type::navigate && f.action->text == "shop" && f.position == 7));
  f = find_action("typing... then type(3, 4, \"ok\")");
  REQUIRE(f);
  CHECK((f.action->type == action_type::type && f.position == 15));
  CHECK_THAT(find_action("I cannot see it").error, Catch::Contains("no action"));
  CHECK_THAT(find_action("click(1, two)").error, Catch::Contains("position 9"));
  // A megabyte of near-actions is refused fast (each candidate reads at most max_length bytes).
  std::string junk;
  while (junk.size() < (1u << 20)) junk += "click(1, 2 scroll(type(\"";
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(find_action(junk));
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}

TEST_CASE("click_reward: 1 inside the box, 0 elsewhere, `invalid` when unparsable, and counts", "[cpu][rewards][vlm]") {
  // Box [8, 24, 16, 32] covers pixels x 8..15, y 24..31.
  const std::string box = "[8, 24, 16, 32]";
  text_batch b{.completions = {"click(12, 30)", "click(8, 24)", "click(15.9, 31.9)", "click(16, 30)", "click(12, 23.5)",
                               "scroll(12, 30, down)", "type(12, 30, \"7\")", "clik(12, 30)", "click(12, nan)",
                               "I click(10, 25) it", ""},
               .references = std::vector<std::string>(11, box)};
  click_reward reward{{.invalid = -0.5}};
  CHECK(values(reward(b)) == std::vector<float>{1, 1, 1, 0, 0, 0, 0, -0.5f, -0.5f, 1, -0.5f});
  auto figures = reward.last_components();
  CHECK(figures["malformed"] == 3.0);
  CHECK(figures["clicks"] == 6.0);
  CHECK(figures["hits"] == 4.0);
  CHECK(figures["malformed_fraction"] == Approx(3.0 / 11.0));
  // whole = true: prose around the action makes it malformed; the default invalid is 0.
  click_reward strict{{.whole = true}};
  CHECK(values(strict(b))[9] == 0.0f);
  CHECK(strict.last_components()["malformed"] == 4.0);
  // The reference may be written as corners; a reference without a box is an error naming it.
  text_batch corners{.completions = {"click(9, 25)"}, .references = {"(8,24),(16,32)"}};
  CHECK(values(click_reward{}(corners)) == std::vector<float>{1});
  text_batch no_box{.completions = {"click(1, 2)"}, .references = {"the 7"}};
  CHECK_THROWS_WITH(click_reward{}(no_box), Catch::Contains("'the 7'"));
  CHECK_THROWS_WITH(click_reward({.hit = std::nan("")}), Catch::Contains("hit"));
}

TEST_CASE("save_canvas_grid draws canvases with true and predicted boxes and clicks", "[cpu][rewards][vlm]") {
#if UNIRL_HAS_STB
  const auto& d = real_digits();
  unirl::data::digit_canvas make(d.images, d.labels, {.size = 32, .min_digits = 2, .max_digits = 2});
  const auto c0 = make(1), c1 = make(2);
  const unirl::data::pixel_box pred{2, 3, 10, 11};
  const auto dir = make_temp_dir("unirl-canvas-grid");
  const auto path = (dir / "sub" / "grid.png").string();
  unirl::data::save_canvas_grid(path, {c0.image, c1.image}, {{pred}, {}}, {c0.boxes, c1.boxes}, {{}, {{20.0, 5.0}}},
                                {.zoom = 2, .columns = 2, .gap = 4});
  int w = 0, h = 0, n = 0;
  unsigned char* px = stbi_load(path.c_str(), &w, &h, &n, 3);
  REQUIRE(px != nullptr);
  CHECK(w == 2 * 64 + 3 * 4);  // two 32-pixel canvases at zoom 2, three gaps
  CHECK(h == 64 + 2 * 4);
  auto at = [&](int x, int y) {
    const auto* p = px + (static_cast<std::size_t>(y) * w + x) * 3;
    return std::array<int, 3>{p[0], p[1], p[2]};
  };
  // Canvas 0 starts at (4, 4): the predicted box's top-left corner is red, the true box's green.
  CHECK(at(4 + 2 * 2, 4 + 3 * 2) == std::array<int, 3>{230, 0, 0});
  const auto& tb = c0.boxes[1];
  CHECK(at(4 + static_cast<int>(tb.x1) * 2, 4 + static_cast<int>(tb.y1) * 2) == std::array<int, 3>{0, 200, 0});
  // Canvas 1 starts at (4 + 64 + 4, 4): the click at pixel (20, 5) is blue.
  CHECK(at(72 + 40, 4 + 10) == std::array<int, 3>{0, 90, 255});
  // A pixel of ink away from the outlines is grey 255 * (1 - value).
  const auto& ib = c1.boxes[0];
  bool found = false;
  for (int y = 1; y < 7 && !found; ++y)
    for (int x = 1; x < 7 && !found; ++x) {
      const float v = c1.image[0][ib.y1 + y][ib.x1 + x].item<float>();
      if (v > 0.5f && !(ib.x1 + x >= 17 && ib.x1 + x <= 23 && ib.y1 + y >= 2 && ib.y1 + y <= 8)) {  // not under the click
        const int g = static_cast<int>(std::lround(255.0 * (1.0 - v)));
        CHECK(at(72 + static_cast<int>(ib.x1 + x) * 2 + 1, 4 + static_cast<int>(ib.y1 + y) * 2 + 1) ==
              std::array<int, 3>{g, g, g});
        found = true;
      }
    }
  CHECK(found);
  stbi_image_free(px);
  CHECK_THROWS_WITH(unirl::data::save_canvas_grid(path, {c0.image}, {{pred}, {pred}}, {}, {}), Catch::Contains("2 lists of boxes"));
  std::filesystem::remove_all(dir);
#else
  WARN("skipped: unirl built without stb");
#endif
}

// ---- Model rewards of the vision-language tasks: CLIP-style alignment and learned consistency ------

namespace {
// Captions of a digit class: the numeral, its name, "a <name>", "the digit <numeral>".
const std::array<const char*, 10> digit_names{"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"};
std::string digit_caption(std::int64_t label, std::size_t form) {
  const std::string name = digit_names[static_cast<std::size_t>(label)], num = std::to_string(label);
  switch (form % 4) {
    case 0: return num;
    case 1: return name;
    case 2: return "a " + name;
    default: return "the digit " + num;
  }
}
// The VLM's image table for 8x8 grey digits (2x2 patches of 4x4 pixels, CLS dropped: 4 ids each).
unirl::models::vlm::vision_cache digit_table(std::int64_t vocab) {
  unirl::models::vision::vision_config v;
  v.image_size = 8;
  v.patch_size = 4;
  v.num_channels = 1;
  return unirl::models::vlm::vision_cache(vocab, v);
}
// A token-track batch: prompt i = [1, image-slot ids of image slots[i]..., 2] (left-padded by a 0
// in front of every other row), one completion text each.
unirl::token_rollout vlm_batch(const unirl::models::vlm::vision_cache& table, const std::vector<std::int64_t>& slots,
                               const std::vector<std::string>& texts) {
  const auto B = static_cast<std::int64_t>(slots.size());
  const auto n = table.tokens(0);
  unirl::token_rollout b;
  b.prompt_ids = torch::zeros({B, n + 3}, torch::kInt64);
  b.prompt_mask = torch::zeros({B, n + 3});
  for (std::int64_t i = 0; i < B; ++i) {
    const std::int64_t start = i % 2 == 0 ? 1 : 0;  // row i % 2 == 0 has one pad in front
    b.prompt_ids[i][start] = 1;
    for (std::int64_t k = 0; k < n; ++k) b.prompt_ids[i][start + 1 + k] = table.token_id(slots[static_cast<std::size_t>(i)]);
    b.prompt_ids[i][start + 1 + n] = 2;
    b.prompt_mask[i].narrow(0, start, n + 2).fill_(1);
  }
  b.completion_ids = torch::zeros({B, 1}, torch::kInt64);
  b.completion_mask = torch::ones({B, 1});
  b.prompt_index = torch::arange(B);
  b.completions = texts;
  return b;
}
}  // namespace

static_assert(unirl::options::reflects_every_member<clip_config>);
static_assert(unirl::options::reflects_every_member<encoder_train_options>);
static_assert(unirl::options::reflects_every_member<classifier_config>);
static_assert(unirl::options::reflects_every_member<answer_class_options>);
static_assert(ScorerFor<clip_alignment<slot_images<unirl::models::vlm::vision_cache>>, unirl::token_rollout>);
static_assert(ScorerFor<clip_alignment<prompt_images>, unirl::token_rollout>);
static_assert(ScorerFor<consistency_reward<slot_images<unirl::models::vlm::vision_cache>>, unirl::token_rollout>);
static_assert(!ScorerFor<clip_alignment<slot_images<unirl::models::vlm::vision_cache>>, text_batch>);  // no prompt_ids

TEST_CASE("info_nce_loss is CLIP's symmetric cross-entropy, on hand values", "[cpu][rewards][vlm]") {
  // Images [2, 0], [0, 3] (normalised: e1, e2); texts [0.6, 0.8], [0, 1]; exp(logit_scale) = 2.
  // L[i][j] = 2 cos(img_i, txt_j) = [[1.2, 0], [1.6, 2]].
  auto img = torch::tensor({2.0f, 0.0f, 0.0f, 3.0f}).view({2, 2});
  auto txt = torch::tensor({0.6f, 0.8f, 0.0f, 1.0f}).view({2, 2});
  auto scale = torch::tensor(std::log(2.0f));
  const double L[2][2] = {{1.2, 0.0}, {1.6, 2.0}};
  auto lse2 = [](double a, double b) { return std::log(std::exp(a) + std::exp(b)); };
  const double i2t = ((lse2(L[0][0], L[0][1]) - L[0][0]) + (lse2(L[1][0], L[1][1]) - L[1][1])) / 2;
  const double t2i = ((lse2(L[0][0], L[1][0]) - L[0][0]) + (lse2(L[0][1], L[1][1]) - L[1][1])) / 2;
  CHECK(info_nce_loss(img, txt, scale).item<double>() == Approx((i2t + t2i) / 2).epsilon(1e-5));
  // Every pair positive: the targets are uniform over each row / column.
  auto all = torch::ones({2, 2}, torch::kBool);
  const double i2t_all = (-(0.5 * (L[0][0] - lse2(L[0][0], L[0][1])) + 0.5 * (L[0][1] - lse2(L[0][0], L[0][1]))) -
                          (0.5 * (L[1][0] - lse2(L[1][0], L[1][1])) + 0.5 * (L[1][1] - lse2(L[1][0], L[1][1])))) / 2;
  const double t2i_all = (-(0.5 * (L[0][0] - lse2(L[0][0], L[1][0])) + 0.5 * (L[1][0] - lse2(L[0][0], L[1][0]))) -
                          (0.5 * (L[0][1] - lse2(L[0][1], L[1][1])) + 0.5 * (L[1][1] - lse2(L[0][1], L[1][1])))) / 2;
  CHECK(info_nce_loss(img, txt, scale, all).item<double>() == Approx((i2t_all + t2i_all) / 2).epsilon(1e-5));
  // The identity as positives is the plain loss; the temperature's gradient reaches logit_scale.
  auto s = torch::tensor(std::log(2.0f)).requires_grad_(true);
  auto loss = info_nce_loss(img, txt, s, torch::eye(2).to(torch::kBool));
  CHECK(loss.item<double>() == Approx((i2t + t2i) / 2).epsilon(1e-5));
  loss.backward();
  REQUIRE(s.grad().defined());
  // d loss / d log s = sum over both directions of (softmax - target) . L, halved: check numerically.
  const double h = 1e-3;
  const double up = info_nce_loss(img, txt, torch::tensor(std::log(2.0f) + static_cast<float>(h))).item<double>();
  const double dn = info_nce_loss(img, txt, torch::tensor(std::log(2.0f) - static_cast<float>(h))).item<double>();
  CHECK(s.grad().item<double>() == Approx((up - dn) / (2 * h)).epsilon(1e-2));
  CHECK_THROWS_WITH(info_nce_loss(img, txt.narrow(0, 0, 1), scale), Catch::Contains("expected two (B, D)"));
  CHECK_THROWS_WITH(info_nce_loss(img, txt, scale, torch::zeros({2, 2}, torch::kBool)), Catch::Contains("no positive pair"));
}

TEST_CASE("tiny_clip trained on the real digits: zero-shot classification and the alignment reward", "[cpu][rewards][vlm]") {
  const auto& d = real_digits();
  const std::int64_t N = d.images.size(0), held = 297, n_train = N - held;
  std::vector<std::string> captions;
  for (std::int64_t i = 0; i < n_train; ++i)
    captions.push_back(digit_caption(d.labels[i].item<std::int64_t>(), static_cast<std::size_t>(i)));
  torch::manual_seed(0);
  tiny_clip clip{clip_config{}};
  const auto tr = train_clip(clip, d.images.narrow(0, 0, n_train), captions, d.labels.narrow(0, 0, n_train),
                             {.steps = 400, .batch = 64, .lr = 3e-3, .seed = 1});
  CHECK(tr.last_loss < tr.first_loss);
  // Zero-shot classification of the held-out digits by the class captions.
  const auto test_x = d.images.narrow(0, n_train, held), test_y = d.labels.narrow(0, n_train, held);
  double acc[4];
  for (std::size_t form = 0; form < 4; ++form) {
    std::vector<std::string> classes;
    for (std::int64_t k = 0; k < 10; ++k) classes.push_back(digit_caption(k, form));
    acc[form] = (zero_shot_classify(clip, test_x, classes) == test_y).to(torch::kFloat64).mean().item<double>();
  }
  WARN("tiny_clip: " << tr.seconds << " s training, loss " << tr.first_loss << " -> " << tr.last_loss
                     << "; zero-shot held-out accuracy by \"7\" " << acc[0] << ", \"seven\" " << acc[1]
                     << ", \"a seven\" " << acc[2] << ", \"the digit 7\" " << acc[3]);
  for (double a : acc) CHECK(a >= 0.8);

  // The reward on a token-track batch: each prompt shows a held-out digit through image-slot ids
  // of the VLM's image table; each image is answered by all ten names.
  auto table = std::make_shared<unirl::models::vlm::vision_cache>(digit_table(20));
  const std::int64_t M = 40;
  std::vector<std::int64_t> slots;
  std::vector<std::string> texts;
  for (std::int64_t i = 0; i < M; ++i) {
    (void)table->add(test_x[i]);
    for (std::int64_t k = 0; k < 10; ++k) {
      slots.push_back(i);
      texts.push_back(digit_names[static_cast<std::size_t>(k)]);
    }
  }
  auto batch = vlm_batch(*table, slots, texts);
  auto align = make_clip_alignment(clip, slot_images{table});
  const auto r = align(batch).view({M, 10});
  REQUIRE(r.size(0) == M);
  auto right = r.gather(1, test_y.narrow(0, 0, M).unsqueeze(1)).squeeze(1);
  auto wrong_mean = (r.sum(1) - right) / 9;
  const double mean_right = right.mean().item<double>(), mean_wrong = wrong_mean.mean().item<double>();
  const double top = (r.argmax(1) == test_y.narrow(0, 0, M)).to(torch::kFloat64).mean().item<double>();
  WARN("clip_alignment on " << M << " held-out digits: mean cos of the right name " << mean_right << ", of the wrong ones "
                            << mean_wrong << "; the right name scores highest for " << top);
  CHECK(mean_right > mean_wrong + 0.2);
  CHECK((right > wrong_mean).to(torch::kFloat64).mean().item<double>() >= 0.9);
  // Sample 10*i + k reads image i: its reward is the cosine of that image's and that text's embeddings.
  {
    torch::NoGradGuard g;
    auto e_img = clip->encode_image(test_x[3].unsqueeze(0));
    auto e_txt = clip->encode_text({digit_names[5]});
    CHECK(r[3][5].item<double>() ==
          Approx(torch::cosine_similarity(e_img, e_txt, 1).item<double>()).margin(1e-5));
  }
  // The per-prompt table gives the same rewards (samples 10i..10i+9 answer prompt i).
  prompt_images by_prompt;
  for (std::int64_t i = 0; i < M; ++i) by_prompt.table->push_back(test_x[i]);
  batch.prompt_index = torch::arange(M).repeat_interleave(10);
  auto align2 = make_clip_alignment(clip, by_prompt);
  CHECK(torch::allclose(align2(batch).view({M, 10}), r, 1e-5, 1e-6));
  // Untrusted completions: empty, huge, binary — a score each, no error.
  auto odd = vlm_batch(*table, {0, 1, 2}, {"", std::string(200000, 'x'), std::string("\xff\x00\x80 7", 5)});
  CHECK(torch::isfinite(align(odd)).all().item<bool>());
  // A prompt without an image, and a table cleared since the prompts were made: clear errors.
  auto no_image = vlm_batch(*table, {0}, {"seven"});
  no_image.prompt_ids.fill_(1);
  CHECK_THROWS_WITH(align(no_image), Catch::Contains("has no image-slot id"));
  table->clear();
  CHECK_THROWS_WITH(align(odd), Catch::Contains("image table holds 0"));
}

TEST_CASE("consistency_reward: a digit classifier scores answers consistent with the image above others", "[cpu][rewards][vlm]") {
  // The answer's class: the last whole number, else the last class name; else none.
  CHECK(answer_class("7", 10) == 7);
  CHECK(answer_class("It is 3, not 8.", 10) == 8);
  CHECK(answer_class("Seven", 10) == 7);
  CHECK(answer_class("one or maybe nine", 10) == 9);
  CHECK(answer_class("12", 10) == -1);
  CHECK(answer_class("7.5", 10) == -1);
  CHECK(answer_class("1e999", 10) == -1);
  CHECK(answer_class("", 10) == -1);
  CHECK(answer_class("sevens", 10) == -1);
  CHECK(answer_class(std::string(100000, '9'), 10) == -1);

  const auto& d = real_digits();
  const std::int64_t N = d.images.size(0), held = 297, n_train = N - held;
  torch::manual_seed(0);
  digit_classifier clf{classifier_config{}};
  const auto tr = train_digit_classifier(clf, d.images.narrow(0, 0, n_train), d.labels.narrow(0, 0, n_train),
                                         {.steps = 300, .batch = 64, .lr = 3e-3, .seed = 2});
  const auto test_x = d.images.narrow(0, n_train, held), test_y = d.labels.narrow(0, n_train, held);
  double acc = 0;
  {
    torch::NoGradGuard g;
    acc = (clf->forward(test_x).argmax(1) == test_y).to(torch::kFloat64).mean().item<double>();
  }
  // Each held-out digit answered consistently ("It is 7.") and inconsistently (the next digit's name).
  auto table = std::make_shared<unirl::models::vlm::vision_cache>(digit_table(20));
  std::vector<std::int64_t> slots;
  std::vector<std::string> texts;
  for (std::int64_t i = 0; i < held; ++i) {
    (void)table->add(test_x[i]);
    const auto y = test_y[i].item<std::int64_t>();
    slots.push_back(i);
    texts.push_back("It is " + std::to_string(y) + ".");
    slots.push_back(i);
    texts.push_back(digit_names[static_cast<std::size_t>((y + 1) % 10)]);
  }
  auto consistent = make_consistency_reward(clf, slot_images{table}, {}, {.chunk_size = 128});
  const auto r = consistent(vlm_batch(*table, slots, texts)).view({held, 2});
  const double mean_ok = r.select(1, 0).mean().item<double>(), mean_bad = r.select(1, 1).mean().item<double>();
  const double ranked = (r.select(1, 0) > r.select(1, 1)).to(torch::kFloat64).mean().item<double>();
  WARN("digit_classifier: " << tr.seconds << " s training, loss " << tr.first_loss << " -> " << tr.last_loss
                            << ", held-out accuracy " << acc << "; consistency reward on " << held
                            << " held-out digits: consistent " << mean_ok << ", inconsistent " << mean_bad
                            << ", consistent above inconsistent for " << ranked);
  CHECK(acc >= 0.85);
  CHECK(mean_ok > mean_bad + 0.5);
  CHECK(ranked >= 0.9);
  // The reward is the classifier's probability of the answered class (sample 0: consistent).
  {
    torch::NoGradGuard g;
    const auto y0 = test_y[0].item<std::int64_t>();
    CHECK(r[0][0].item<double>() == Approx(torch::softmax(clf->forward(test_x.narrow(0, 0, 1)), 1)[0][y0].item<double>()).margin(1e-5));
  }
  // Answers naming no digit get `invalid`; malformed text never throws.
  auto odd = vlm_batch(*table, {0, 1, 2, 3}, {"", "12", std::string(300000, '('), "no idea"});
  CHECK(values(make_consistency_reward(clf, slot_images{table}, {.invalid = -1.0})(odd)) == std::vector<float>{-1, -1, -1, -1});
  CHECK_THROWS_WITH(make_consistency_reward(clf, slot_images{table}, {}, {.crops = 1}), Catch::Contains("do not apply"));
}
