// JSONL prompt data (records, errors, seeded epochs, resumable position) and the SFT loss.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include <torch/torch.h>

#include <unirl/data/jsonl.hpp>
#include <unirl/models/gpt.hpp>
#include <unirl/train/sft.hpp>

#include "config_errors.hpp"

namespace {
struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() / ("unirl_data_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~temp_dir() { std::filesystem::remove_all(path); }
  std::string write(const std::string& name, const std::string& text) const {
    const auto p = path / name;
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }
};

using unirl_test::error_of;
}  // namespace

TEST_CASE("jsonl: records with text, chat messages, nested keys and numeric answers", "[cpu]") {
  temp_dir d;
  const auto path = d.write("a.jsonl",
                            "{\"q\": \"1+1=\", \"a\": 2}\n"
                            "\n"
                            "{\"q\": [{\"role\": \"user\", \"content\": \"hi\"}], \"a\": \"x\"}\r\n"
                            "{\"q\": \"pi\", \"a\": 3.5, \"extra\": [1, 2]}\n");
  const auto recs = unirl::data::read_jsonl({.path = path, .prompt_key = "q", .answer_key = "a"});
  REQUIRE(recs.size() == 3);
  CHECK(recs[0].prompt == "1+1=");
  CHECK(recs[0].answer == "2");
  CHECK(recs[0].line == 1);
  CHECK(recs[1].prompt.empty());
  REQUIRE(recs[1].messages.size() == 1);
  CHECK(recs[1].messages[0].role == "user");
  CHECK(recs[1].messages[0].content == "hi");
  CHECK(recs[1].line == 3);
  CHECK(recs[2].answer == "3.5");

  const auto nested = d.write("n.jsonl", "{\"in\": {\"text\": \"t\"}, \"meta\": {\"gold\": \"g\"}}\n");
  const auto n = unirl::data::read_jsonl({.path = nested, .prompt_key = "in.text", .answer_key = "meta.gold"});
  REQUIRE(n.size() == 1);
  CHECK(n[0].prompt == "t");
  CHECK(n[0].answer == "g");
  CHECK(unirl::data::read_jsonl({.path = path, .prompt_key = "q", .answer_key = "a", .max_records = 2}).size() == 2);
}

TEST_CASE("jsonl: a bad record names the file, the line and the field", "[cpu]") {
  temp_dir d;
  const auto check = [&](const std::string& text, const std::vector<std::string>& parts) {
    const auto p = d.write("bad.jsonl", text);
    const auto msg = error_of([&] { unirl::data::read_jsonl({.path = p}); });
    INFO(msg);
    REQUIRE(!msg.empty());
    for (const auto& part : parts) CHECK(msg.find(part) != std::string::npos);
  };
  check("{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": \"b\"}\n", {"bad.jsonl:2", "'answer'", "missing"});
  check("{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": \"b\", \"answer\": \"1\"\n", {"bad.jsonl:2", "not valid JSON"});
  check("[1, 2]\n", {"bad.jsonl:1", "JSON object", "array"});
  check("{\"prompt\": 7, \"answer\": \"1\"}\n", {"bad.jsonl:1", "'prompt'", "number"});
  check("{\"prompt\": \"a\", \"answer\": null}\n", {"bad.jsonl:1", "'answer'", "null"});
  check("{\"prompt\": [{\"role\": \"user\"}], \"answer\": \"1\"}\n", {"bad.jsonl:1", "prompt[0]", "content"});
  check("\n\n", {"holds no records"});
  CHECK(error_of([&] { unirl::data::read_jsonl({.path = (d.path / "missing.jsonl").string()}); }).find("cannot open") !=
        std::string::npos);
}

TEST_CASE("jsonl_dataset: every record once per epoch, seeded order, position resumes", "[cpu]") {
  temp_dir d;
  std::string text;
  for (int i = 0; i < 10; ++i) text += "{\"prompt\": \"p" + std::to_string(i) + "\", \"answer\": \"" + std::to_string(i) + "\"}\n";
  const auto path = d.write("ten.jsonl", text);
  unirl::data::jsonl_dataset a({.path = path, .seed = 3});
  std::vector<std::string> first_epoch, second_epoch;
  for (const auto& r : a.next(10)) first_epoch.push_back(r.answer);
  for (const auto& r : a.next(10)) second_epoch.push_back(r.answer);
  CHECK(std::set<std::string>(first_epoch.begin(), first_epoch.end()).size() == 10);
  CHECK(std::set<std::string>(second_epoch.begin(), second_epoch.end()).size() == 10);
  CHECK(first_epoch != second_epoch);  // a fresh permutation per epoch
  unirl::data::jsonl_dataset same({.path = path, .seed = 3}), other({.path = path, .seed = 4});
  std::vector<std::string> s3, s4;
  for (const auto& r : same.next(10)) s3.push_back(r.answer);
  for (const auto& r : other.next(10)) s4.push_back(r.answer);
  CHECK(s3 == first_epoch);
  CHECK(s4 != first_epoch);
  unirl::data::jsonl_dataset ordered({.path = path, .shuffle = false});
  CHECK(ordered.next(3)[2].answer == "2");

  // Save mid-epoch, continue; a fresh dataset loading the position draws the same records.
  unirl::data::jsonl_dataset run({.path = path, .seed = 5});
  (void)run.next(7);
  torch::serialize::OutputArchive out;
  run.save(out);
  const auto ckpt = (d.path / "pos.pt").string();
  out.save_to(ckpt);
  std::vector<std::string> expected;
  for (const auto& r : run.next(25)) expected.push_back(r.answer);
  unirl::data::jsonl_dataset resumed({.path = path, .seed = 5});
  torch::serialize::InputArchive in;
  in.load_from(ckpt);
  resumed.load(in);
  std::vector<std::string> got;
  for (const auto& r : resumed.next(25)) got.push_back(r.answer);
  CHECK(got == expected);

  // A checkpoint of other records is refused and leaves the dataset unchanged.
  const auto other_path = d.write("nine.jsonl", text.substr(0, text.rfind("{\"prompt\"")));
  unirl::data::jsonl_dataset nine({.path = other_path, .seed = 5});
  torch::serialize::InputArchive in2;
  in2.load_from(ckpt);
  CHECK_THROWS_AS(nine.load(in2), unirl::checkpoint_error);
  CHECK(nine.cursor() == 0);
}

TEST_CASE("sft_loss equals the cross-entropy of the completion tokens", "[cpu]") {
  torch::manual_seed(0);
  unirl::models::gpt model({.vocab_size = 11, .max_len = 16, .n_layer = 1, .n_head = 2, .d_model = 16});
  const std::vector<std::vector<std::int64_t>> prompts{{1, 2, 3}, {4}}, answers{{5, 6}, {7, 8, 9, 1}};
  const auto b = unirl::train::make_sft_batch(prompts, answers, 10);
  CHECK(b.tokens() == 6);
  const auto loss = unirl::train::sft_loss(model, b);
  // Independent: each sequence alone, unpadded, through the full forward and F::cross_entropy.
  double total = 0.0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    std::vector<std::int64_t> seq = prompts[i];
    seq.insert(seq.end(), answers[i].begin(), answers[i].end());
    const auto ids = torch::tensor(seq, torch::kInt64).unsqueeze(0);
    const auto logits = model.logits(ids, torch::ones_like(ids, torch::kFloat)).squeeze(0);
    const auto P = static_cast<std::int64_t>(prompts[i].size()), n = static_cast<std::int64_t>(seq.size());
    total += torch::nn::functional::cross_entropy(logits.slice(0, P - 1, n - 1), ids.squeeze(0).slice(0, P, n),
                                                  torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                 .item<double>();
  }
  CHECK(loss.item<double>() == Approx(total / 6.0).epsilon(1e-5));
  CHECK_THROWS_WITH(unirl::train::make_sft_batch({{1}}, {{}}, 0), Catch::Contains("completion 0 is empty"));
}
