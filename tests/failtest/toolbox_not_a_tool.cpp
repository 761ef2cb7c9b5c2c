// Every tool of an agents::toolbox must model unirl::Tool: one without a JSON schema of its
// arguments (parameters()) is rejected at the toolbox with a message naming the concept.
#include <string>

#include <nlohmann/json.hpp>
#include <unirl/agents/toolbox.hpp>

struct echo {
  std::string name() const { return "echo"; }
  std::string description() const { return "Repeats its text."; }
#if !defined(UNIRL_FAILTEST_KO)
  nlohmann::json parameters() const { return {{"type", "object"}}; }
#endif
  std::string call(const nlohmann::json& args) const { return args.dump(); }
};

template class unirl::agents::toolbox<echo>;
