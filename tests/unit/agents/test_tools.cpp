// Tool calls a model wrote (issue 25): the parser's faults, the schema check, toolboxes composed
// at compile time (faults, time limits and throws counted, calls run concurrently on the pool),
// the chat templates' tool turns, a toolbox's selected tools and the built-ins a recipe names.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <unirl/agents/builtin.hpp>
#include <unirl/agents/toolbox.hpp>
#include <unirl/tokenizers/chat.hpp>

using namespace unirl;
using namespace unirl::agents;
using nlohmann::json;

namespace {
// Adds two integers.
struct adder {
  std::string name() const { return "add"; }
  std::string description() const { return "Adds two integers."; }
  json parameters() const {
    return {{"type", "object"},
            {"properties", {{"a", {{"type", "integer"}}}, {"b", {{"type", "integer"}}}}},
            {"required", {"a", "b"}},
            {"additionalProperties", false}};
  }
  std::string call(const json& args) const { return std::to_string(args["a"].get<std::int64_t>() + args["b"].get<std::int64_t>()); }
};
// Always throws.
struct broken {
  std::string name() const { return "broken"; }
  std::string description() const { return "Fails."; }
  json parameters() const { return {{"type", "object"}}; }
  std::string call(const json&) const { throw std::runtime_error("disk on fire"); }
};
// Sleeps `ms` (an argument), stopping early when asked; counts the calls running at once.
struct sleeper {
  std::shared_ptr<std::atomic<int>> running = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<int>> most = std::make_shared<std::atomic<int>>(0);
  std::string name() const { return "sleep"; }
  std::string description() const { return "Sleeps."; }
  json parameters() const {
    return {{"type", "object"}, {"properties", {{"ms", {{"type", "integer"}, {"minimum", 0}}}}}, {"required", {"ms"}}};
  }
  std::string call(const json& args) const { return call(args, std::stop_token{}); }
  std::string call(const json& args, std::stop_token st) const {
    const int now = ++*running;
    int m = most->load();
    while (now > m && !most->compare_exchange_weak(m, now)) {}
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(args["ms"].get<std::int64_t>());
    while (std::chrono::steady_clock::now() < until && !st.stop_requested())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    --*running;
    return st.stop_requested() ? "stopped" : "slept";
  }
};
struct not_a_tool {
  std::string name() const { return "x"; }
  std::string call(const json&) const { return ""; }  // no description() or parameters()
};
static_assert(Tool<adder> && Tool<broken> && StoppableTool<sleeper> && !StoppableTool<adder>);
static_assert(!Tool<not_a_tool>);

std::string call_text(const std::string& name, const json& args) { return tokenizers::tool_call_text(name, args); }
}  // namespace

TEST_CASE("tool calls: parsed from Hermes / Qwen2.5 text, faults named with their reason", "[agents][cpu]") {
  const auto ok = find_tool_calls("I will add. <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>");
  REQUIRE(ok.size() == 1);
  REQUIRE(ok[0].ok());
  CHECK(ok[0].call->name == "add");
  CHECK(ok[0].call->arguments == json{{"a", 2}, {"b", 3}});
  CHECK(ok[0].position == 12);
  // Llama 3.1 writes "parameters"; two calls in one turn.
  const auto two = find_tool_calls("<tool_call>{\"name\": \"f\", \"parameters\": {\"x\": 1}}</tool_call><tool_call>{\"name\": \"g\"}</tool_call>");
  REQUIRE(two.size() == 2);
  CHECK(two[0].call->arguments == json{{"x", 1}});
  CHECK(two[1].call->arguments == json::object());

  auto fault_of = [](const std::string& text) {
    const auto r = find_tool_calls(text, {.max_call_bytes = 64, .max_depth = 4, .max_calls = 2});
    REQUIRE(!r.empty());
    CHECK(!r.back().ok());
    return std::pair{r.back().fault, r.back().error};
  };
  CHECK(fault_of("<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1,}}</tool_call>").first == tool_fault::malformed);
  CHECK(fault_of("<tool_call>[1, 2]</tool_call>").first == tool_fault::malformed);
  CHECK(fault_of("<tool_call>{\"arguments\": {}}</tool_call>").second.find("no string \"name\"") != std::string::npos);
  const auto [f1, e1] = fault_of("<tool_call>{\"name\": \"add\", \"arguments\": [1]}</tool_call>");
  CHECK(f1 == tool_fault::bad_arguments);
  CHECK(e1 == "the arguments of 'add' are array; expected an object");
  CHECK(fault_of("<tool_call>{\"name\": \"add\"").second == "a <tool_call> at byte 0 has no </tool_call>");
  const auto [f2, e2] = fault_of("<tool_call>" + std::string(100, ' ') + "</tool_call>");
  CHECK(f2 == tool_fault::too_large);
  CHECK(e2 == "the tool call has 100 bytes; at most 64 are accepted");
  CHECK(fault_of("<tool_call>[[[[[1]]]]]</tool_call>").second == "the tool call's JSON is nested deeper than 4 levels");
  // Brackets inside strings are not nesting.
  CHECK(find_tool_calls("<tool_call>{\"name\": \"[[[[[[\"}</tool_call>", {.max_depth = 4})[0].ok());
  const auto many = find_tool_calls(std::string(3, ' ') + "<tool_call>{\"name\":\"a\"}</tool_call><tool_call>{\"name\":\"a\"}</tool_call>"
                                    "<tool_call>{\"name\":\"a\"}</tool_call>", {.max_calls = 2});
  REQUIRE(many.size() == 3);
  CHECK(many[2].fault == tool_fault::too_large);
  // Deep nesting the JSON parser would recurse into: refused before it parses (no stack overflow).
  const auto deep = find_tool_calls("<tool_call>" + std::string(200000, '[') + "</tool_call>", {.max_call_bytes = 1 << 20});
  CHECK(deep[0].fault == tool_fault::too_large);
  CHECK(find_tool_calls("no call here").empty());
}

TEST_CASE("tool calls: arguments checked against the tool's JSON schema, the mismatch named by its path", "[agents][cpu]") {
  const auto s = adder{}.parameters();
  CHECK(check_arguments(s, {{"a", 1}, {"b", 2}}).empty());
  CHECK(check_arguments(s, {{"a", 1.0}, {"b", 2}}).empty());  // JSON Schema: 1.0 is an integer
  CHECK(check_arguments(s, {{"a", "1"}, {"b", 2}}) == "arguments.a = \"1\": expected integer");
  CHECK(check_arguments(s, {{"a", 1.5}, {"b", 2}}) == "arguments.a = 1.5: expected integer");
  CHECK(check_arguments(s, {{"a", 1}}) == "arguments: the required argument 'b' is missing");
  CHECK(check_arguments(s, {{"a", 1}, {"b", 2}, {"c", 3}}) == "arguments: unknown argument 'c'");
  const json nested = {{"type", "object"},
                       {"properties",
                        {{"op", {{"type", "string"}, {"enum", {"add", "mul"}}}},
                         {"xs", {{"type", "array"}, {"items", {{"type", "number"}, {"maximum", 10}}}}},
                         {"tag", {{"type", {"string", "null"}}, {"maxLength", 3}}}}}};
  CHECK(check_arguments(nested, {{"op", "add"}, {"xs", {1, 2.5}}, {"tag", nullptr}}).empty());
  CHECK(check_arguments(nested, {{"op", "div"}}) == "arguments.op = \"div\": expected one of [\"add\",\"mul\"]");
  CHECK(check_arguments(nested, {{"xs", {1, 11}}}) == "arguments.xs[1] = 11: expected <= 10");
  CHECK(check_arguments(nested, {{"tag", 5}}) == "arguments.tag = 5: expected string or null");
  CHECK(check_arguments(nested, {{"tag", "long"}}) == "arguments.tag has 4 bytes: expected at most 3");
}

TEST_CASE("toolbox: every call gets one reply; unknown tools, bad arguments, throws and time-outs are counted", "[agents][cpu]") {
  sleeper sl;
  toolbox<adder, broken, sleeper> tools{{.timeout_seconds = 0.2, .threads = 2, .limits = {.max_calls = 8}}, adder{}, broken{}, sl};
  CHECK(tools.names() == std::vector<std::string>{"add", "broken", "sleep"});
  const auto defs = tools.definitions();
  REQUIRE(defs.size() == 3);
  CHECK(defs[0] == json{{"type", "function"},
                        {"function", {{"name", "add"}, {"description", "Adds two integers."}, {"parameters", adder{}.parameters()}}}});

  const std::string text = call_text("add", {{"a", 40}, {"b", 2}}) + call_text("mul", {{"a", 1}}) +
                           call_text("add", {{"a", "x"}, {"b", 2}}) + call_text("broken", json::object()) +
                           "<tool_call>{oops}</tool_call>" + call_text("sleep", {{"ms", 5000}});
  const auto t0 = std::chrono::steady_clock::now();
  auto turn = tools.begin_turn(text);
  CHECK(turn.size() == 6);
  tools.wait(turn);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(waited < 2.0);  // the 5 s call is abandoned at its 0.2 s limit, not waited for
  const auto r = turn.replies();
  REQUIRE(r.size() == 6);
  CHECK(r[0] == "42");
  CHECK(r[1] == "error: there is no tool named 'mul'; the tools are add, broken, sleep");
  CHECK(r[2] == "error: bad arguments for 'add': arguments.a = \"x\": expected integer");
  CHECK(r[3] == "error: the tool 'broken' failed: disk on fire");
  CHECK(r[4].rfind("error: the tool call is not valid JSON", 0) == 0);
  CHECK(r[5].rfind("error: the tool 'sleep' did not answer within 0.2", 0) == 0);
  CHECK(turn.replies() == r);  // resolved once
  const auto s = tools.stats();
  CHECK(s.calls == 6);
  CHECK(s.ok == 1);
  CHECK(s.count(tool_fault::unknown_tool) == 1);
  CHECK(s.count(tool_fault::bad_arguments) == 1);
  CHECK(s.count(tool_fault::threw) == 1);
  CHECK(s.count(tool_fault::malformed) == 1);
  CHECK(s.count(tool_fault::timed_out) == 1);
  CHECK(s.to_map().at("tool/timed_out") == 1.0);
  // The abandoned call was asked to stop (it is a StoppableTool): its worker comes back.
  for (int i = 0; i < 200 && sl.running->load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(sl.running->load() == 0);
}

TEST_CASE("toolbox: calls run concurrently on the bounded pool, never more than its threads", "[agents][cpu]") {
  sleeper sl;
  toolbox<sleeper> tools{{.timeout_seconds = 5.0, .threads = 3, .limits = {.max_calls = 8}}, sl};
  std::string text;
  for (int i = 0; i < 6; ++i) text += call_text("sleep", {{"ms", 100}});
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = tools.call(text);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(r == std::vector<std::string>(6, "slept"));
  CHECK(sl.most->load() == 3);
  CHECK(secs >= 0.19);  // two rounds of three
  CHECK(secs < 0.55);   // not six rounds of one
}

TEST_CASE("toolbox: configuration errors name the value", "[agents][cpu]") {
  CHECK_THROWS_WITH((toolbox<adder, adder>{adder{}, adder{}}), Catch::Contains("two tools are named 'add'"));
  CHECK_THROWS_WITH((toolbox<adder>{{.threads = 0}, adder{}}), Catch::Contains("threads"));
}

TEST_CASE("toolbox: select keeps the named tools; the others are neither listed nor called", "[agents][cpu]") {
  toolbox<adder, broken> tools{{.timeout_seconds = 1.0}, adder{}, broken{}};
  tools.select({"broken"});
  CHECK(tools.names() == std::vector<std::string>{"broken"});
  REQUIRE(tools.definitions().size() == 1);
  CHECK(tools.definitions()[0]["function"]["name"] == "broken");
  const auto r = tools.call(call_text("add", {{"a", 1}, {"b", 2}}));
  REQUIRE(r.size() == 1);
  CHECK(r[0] == "error: there is no tool named 'add'; the tools are broken");
  CHECK(tools.stats().count(tool_fault::unknown_tool) == 1);
  tools.select({});
  CHECK(tools.names().empty());
  CHECK(tools.definitions().empty());
  CHECK_THROWS_WITH(tools.select({"add", "mul"}), Catch::Contains("unknown tool 'mul'; the tools are add, broken"));
}

TEST_CASE("built-ins: the calculator, the arithmetic environment and their registries by name", "[agents][cpu]") {
  auto tools = make_builtin_toolbox({.timeout_seconds = 1.0});
  CHECK(tools.names() == builtin_tool_names());
  CHECK(tools.call(call_text("calculator", {{"expression", "347*58+1"}})) == std::vector<std::string>{"20127"});
  const auto bad = tools.call(call_text("calculator", {{"expression", "2**3"}}));
  REQUIRE(bad.size() == 1);
  CHECK(bad[0] == "error: the tool 'calculator' failed: expected a number at position 2 of '2**3'");
  CHECK(evaluate_expression("12-3*4") == 0);
  CHECK_THROWS_WITH(evaluate_expression("1234567890123*1"), Catch::Contains("more than 12 digits"));
  CHECK_THROWS_WITH(evaluate_expression("999999999999*999999999999"), Catch::Contains("too large"));
  arithmetic_env env;
  const auto obs = env.reset(7);
  CHECK(obs.text == "What is " + env.expression + "?");
  CHECK(env.answer == evaluate_expression(env.expression));
  CHECK(env.answer >= 100 * 10);
  CHECK(env.step(std::to_string(env.answer) + "\n").reward == 1.0);
  CHECK(env.step(std::to_string(env.answer + 1)).reward == 0.0);
  CHECK(env.step("").done);
  int found = 0;
  with_builtin_environment("arithmetic", [&](auto e) {
    found += std::is_same_v<decltype(e), arithmetic_env>;
    CHECK(e.reset(7).text == obs.text);
  });
  CHECK(found == 1);
  CHECK(builtin_environment_names() == std::vector<std::string>{"arithmetic", "guess_number"});
  with_builtin_environment("guess_number", [&](auto e) {
    found += std::is_same_v<decltype(e), envs::guess_number>;
    CHECK(e.reset(7).text == envs::guess_number{}.reset(7).text);
  });
  CHECK(found == 2);
  CHECK_THROWS_WITH(with_builtin_environment("sokoban", [](auto) {}),
                    Catch::Contains("unknown environment 'sokoban'; the built-in environments are arithmetic, guess_number"));
  CHECK_THROWS_WITH(check_builtin_tools({"calculator", "browser"}),
                    Catch::Contains("unknown tool 'browser'; the built-in tools are calculator"));
  CHECK_THROWS_WITH(check_builtin_tools({"calculator", "calculator"}), Catch::Contains("listed twice"));
  check_builtin_tools({"calculator"});
}

TEST_CASE("chat templates: tool turns of Qwen2.5 / Hermes and Llama 3.1's ipython role", "[agents][cpu]") {
  using tokenizers::chat_format;
  const json tool = {{"type", "function"},
                     {"function", {{"name", "add"}, {"description", "Adds."}, {"parameters", {{"type", "object"}}}}}};
  const std::vector<tokenizers::chat_message> conv{
      {"user", "2+3?"},
      {"assistant", tokenizers::tool_call_text("add", {{"a", 2}, {"b", 3}})},
      {"tool", "5"},
      {"tool", "ok"},
      {"assistant", "5"}};
  const std::string tools_block =
      "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
      "function signatures within <tools></tools> XML tags:\n<tools>\n{\"function\": {\"description\": \"Adds.\", "
      "\"name\": \"add\", \"parameters\": {\"type\": \"object\"}}, \"type\": \"function\"}\n</tools>\n\nFor each "
      "function call, return a json object with function name and arguments within <tool_call></tool_call> XML "
      "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
  const std::string turns =
      "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
      "{\"a\": 2, \"b\": 3}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
      "<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n";
  CHECK(tokenizers::apply_chat_template(chat_format::qwen2_5, conv, false, {tool}) ==
        "<|im_start|>system\n" + std::string(tokenizers::qwen2_5_default_system) + "\n\n" + tools_block + turns);
  CHECK(tokenizers::apply_chat_template(chat_format::chatml, conv, false, {tool}) == "<|im_start|>system\n" + tools_block + turns);
  // The continuation after the tool-calling turn is exactly what the whole rendering holds there.
  const auto prefix = tokenizers::apply_chat_template(chat_format::chatml, {conv[0]}, true, {tool});
  const auto cont = tokenizers::render_continuation(chat_format::chatml, {conv[2], conv[3]});
  CHECK(prefix + conv[1].content + cont + "5<|im_end|>\n" ==
        tokenizers::apply_chat_template(chat_format::chatml, conv, false, {tool}));
  // Llama 3.1: a tool's reply is the ipython role.
  CHECK(tokenizers::apply_chat_template(chat_format::llama3, {{"user", "2+3?"}, {"assistant", "{\"name\": \"add\"}"}, {"tool", "5"}}) ==
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+3?<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\n{\"name\": \"add\"}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK(tokenizers::render_continuation(chat_format::llama3, {{"ipython", "5"}}) ==
        "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK_THROWS_WITH(tokenizers::apply_chat_template(chat_format::llama3, conv, true, {tool}),
                    Catch::Contains("chatml and qwen2_5 formats only"));
  // Jinja's tojson: Python's separators, non-ASCII kept.
  CHECK(tokenizers::to_json_text(json{{"b", {1, 2}}, {"a", "é\n"}}) == "{\"a\": \"é\\n\", \"b\": [1, 2]}");
}
