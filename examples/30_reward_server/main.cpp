// A reward server: hosts a composed local reward (exact answer + format + DAPO overlong penalty)
// behind unirl's reward-service JSON schema, so training processes on other machines score with
// `unirl::rewards::remote_scorer`. Settings are unirl options: `key=value` overrides or
// `--recipe file.json`, e.g.
//
//   reward_server server.port=8000 server.host=0.0.0.0 reward.weights=[1,0.2,1] overlong.max_length=64
//   reward_server --self-test        # serve on an ephemeral port, score a batch remotely, compare
//   reward_server server.max_connections=8192 server.queue_depth=4096 server.max_body_bytes=67108864
//
// SIGINT / SIGTERM stop it cleanly: it stops accepting, answers the requests it holds, prints
// how many it served and exits 0; a second signal while it stops exits at once (128 + signal).
//
// Then, from a trainer: `remote_scorer{{.url = "http://<host>:8000/score"}}` as the reward.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/core/command_line.hpp>
#include <unirl/core/options.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/rules.hpp>
#include <unirl/rewards/server.hpp>
#include <unirl/rewards/weighted.hpp>

namespace rw = unirl::rewards;

struct example_options {
  rw::server_options server{.host = "127.0.0.1", .port = 8000};
  rw::weighted_options reward{.weights = {1.0, 0.2, 1.0}};
  rw::exact_answer_options exact{.extract = R"(=\s*(-?\d+)\s*$)", .numeric = true};
  rw::regex_format_options format{.pattern = R"(\s*-?\d+\s*[-+*]\s*-?\d+\s*=\s*-?\d+\s*)"};
  rw::overlong_options overlong{.max_length = 24, .cache_length = 8};
};
BOOST_HANA_ADAPT_STRUCT(example_options, server, reward, exact, format, overlong);

using reward_t = rw::weighted<rw::exact_answer, rw::regex_format, rw::overlong_penalty>;

namespace {
reward_t make_reward(const example_options& o) {
  return reward_t{o.reward, rw::exact_answer{o.exact}, rw::regex_format{o.format}, rw::overlong_penalty{o.overlong}};
}

// A demo batch: answers to small sums, some right, some wrong, some badly formatted or too long.
rw::json_batch demo_batch() {
  rw::json_batch b;
  b.completions = {"12+30=42", "12+30=41", "42", "7*6 = 42", "12+30=42 and some more words after it", "3-5=-2"};
  b.references = {"42", "42", "42", "42", "42", "-2"};
  b.prompts = {"12+30", "12+30", "12+30", "7*6", "12+30", "3-5"};
  b.count = static_cast<std::int64_t>(b.completions.size());
  return b;
}

int self_test(example_options o) {
  o.server.port = 0;
  o.server.host = "127.0.0.1";
  rw::reward_server server{make_reward(o), o.server};
  server.start();
  std::cout << "serving on " << server.url() << "\n";
  auto local = make_reward(o);
  const auto batch = demo_batch();
  const auto expected = local(batch);
  rw::remote_scorer remote{{.url = server.url(), .timeout_s = 10, .retries = 2}};
  const auto t0 = std::chrono::steady_clock::now();
  const auto got = remote(batch);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "completion                                   remote   local\n";
  for (std::int64_t i = 0; i < batch.size(); ++i)
    std::printf("%-44s %6.3f  %6.3f\n", batch.completions[static_cast<std::size_t>(i)].c_str(), got[i].item<double>(),
                expected[i].item<double>());
  for (const auto& [k, v] : remote.last_components()) std::printf("component %-20s %.4f\n", k.c_str(), v);
  std::printf("round trip: %.2f ms for %lld samples\n", ms, static_cast<long long>(batch.size()));
  bool ok = torch::equal(got, expected);
  std::cout << (ok ? "self-test passed: remote rewards equal local rewards\n" : "self-test FAILED: rewards differ\n");
  // Completions are untrusted text: one of 100 000 characters is scored like any other (RE2 runs
  // in linear time and bounded stack), and the server keeps serving.
  rw::json_batch long_one;
  long_one.completions = {"1+1=" + std::string(100000, '2')};
  long_one.references = {"2"};
  long_one.prompts = {"1+1"};
  long_one.count = 1;
  const auto long_got = remote(long_one);
  const bool long_ok = torch::equal(long_got, local(long_one)) && torch::equal(remote(batch), expected);
  std::cout << (long_ok ? "self-test passed: a 100 000-character completion is scored, the server still serves\n"
                        : "self-test FAILED on a 100 000-character completion\n");
  ok = ok && long_ok;
  server.stop();
  return ok ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    example_options o;
    const auto flags = unirl::options::parse_command_line(o, argc, argv);
    bool test = false;
    for (const auto& f : flags) {
      if (f == "--self-test") test = true;
      else if (f == "--help" || f == "-h") {
        std::cout << "usage: reward_server [--self-test] [--recipe FILE] [key=value ...]\noptions:\n"
                  << unirl::options::to_string(o);
        return 0;
      } else {
        std::cerr << "unknown flag " << f << " (see --help)\n";
        return 2;
      }
    }
    if (test) return self_test(o);

    rw::reward_server server{make_reward(o), o.server};
    server.start();
    std::cout << unirl::options::to_string(o) << "reward server listening on " << server.url()
              << " (POST JSON; GET /health); Ctrl-C stops it\n"
              << std::flush;
    const int sig = rw::serve_until_signal(server);  // then stopped: every request held was answered
    std::cout << "signal " << sig << ": stopped after " << server.served() << " requests\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
