// Local rewards: rule scorers, the weighted composer (static and adaptive weights), embedding
// alignment, learned reward models (torch::nn and TorchScript, multi-scale / multi-crop), and the
// evaluation metrics BLEU and SSIM against published reference values.
#include <catch2/catch.hpp>

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
#include <unirl/eval/bleu.hpp>
#include <unirl/eval/ssim.hpp>
#include <unirl/rewards/alignment.hpp>
#include <unirl/rewards/model.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/weighted.hpp>
#include <unirl/rollout/flow.hpp>
#include <unirl/rollout/token.hpp>

#include "test_batches.hpp"

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
