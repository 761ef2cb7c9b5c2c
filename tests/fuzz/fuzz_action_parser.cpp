// libFuzzer target: the agent-action parser (rewards/action_parser.hpp, torch-free) on text a
// model could write.
//   bash scripts/fuzz.sh action_parser 60
// The whole input is the text; parse_action and find_action run on it with the default limits
// and with tiny ones. Findings: an exception, a crash, undefined behaviour, a leak, or a broken
// invariant: an accepted action has finite coordinates within max_coordinate and a text (a type's,
// a navigate's page) of at most max_text bytes; its canonical form (to_string) parses back to the same canonical form; when the
// whole text is one action, find_action finds that very action; a rejected text has a reason.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <unirl/rewards/action_parser.hpp>

namespace {
namespace ur = unirl::rewards;

void check(bool ok) {
  if (!ok) std::abort();
}

void check_action(const ur::action& a, const ur::action_limits& lim) {
  for (double v : {a.x, a.y, a.dx, a.dy}) check(std::isfinite(v) && std::abs(v) <= lim.max_coordinate);
  check(a.text.size() <= lim.max_text);
  check(a.type == ur::action_type::type || a.type == ur::action_type::navigate || a.text.empty());
}

void run(std::string_view text, const ur::action_limits& lim) {
  const auto p = ur::parse_action(text, lim);
  check(p.ok() != !p.error.empty());
  if (p) {
    check_action(*p.action, lim);
    const std::string canonical = ur::to_string(*p.action);
    ur::action_limits roomy = lim;
    roomy.max_length = canonical.size() + 1;
    roomy.max_number_chars = 64;
    const auto again = ur::parse_action(canonical, roomy);
    check(again.ok() && ur::to_string(*again.action) == canonical);
    const auto f = ur::find_action(text, lim);
    check(f.ok() && ur::to_string(*f.action) == canonical);
  }
  const auto f = ur::find_action(text, lim);
  check(f.ok() != !f.error.empty());
  if (f) {
    check_action(*f.action, lim);
    check(f.position < text.size());
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  run(text, {});
  run(text, {.max_length = 16, .max_number_chars = 4, .max_coordinate = 100.0, .max_text = 2});
  return 0;
}
