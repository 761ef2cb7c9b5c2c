// libFuzzer target: the HTTP/1.1 request reader (rewards/http_reader.hpp: Beast's parser with
// the server's head / body limits, head deadline and minimum body rate), the state machine every
// connection of json_http_server runs. Torch-free.
//   bash scripts/fuzz.sh http_reader 60
// Input: 4 bytes of limits (head limit, body limit, body rate, head timeout), then segments, each
// [length byte][time step byte, 10 ms units][bytes]: the bytes arrive at that time, as a socket
// delivers them. The same bytes are also fed at once (in reads of read_size(), no time passing).
// Findings: a crash, undefined behaviour, a leak, or a broken invariant:
//  - at most max_header_bytes + 1 unparsed bytes are held while reading a head, at most
//    2 x body_read_size in a body (one read, plus a partial chunk line);
//  - the deadline never moves earlier while a request is read; a reader past it is timed out;
//  - every parsed request keeps to the limits (body <= max_body_bytes);
//  - splitting and timing do not change what is parsed: the requests completed with time passing
//    are a prefix of those completed at once (all of them unless it timed out), and where both
//    end refused, with the same status (but 400 / 431 for a head both malformed and too long).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <unirl/rewards/http_reader.hpp>

namespace {
namespace ur = unirl::rewards;
using clock_type = std::chrono::steady_clock;

// A broken invariant: say which (the line), then abort (libFuzzer keeps the input).
#define check(ok)                                                                  \
  do {                                                                             \
    if (!(ok)) {                                                                   \
      std::fprintf(stderr, "fuzz_http_reader: invariant failed, line %d: %s\n", __LINE__, #ok); \
      std::abort();                                                                \
    }                                                                              \
  } while (0)

struct parsed {
  std::string method, target, body;
  unsigned version;
  bool keep_alive;
  bool operator==(const parsed&) const = default;
};

struct outcome {
  std::vector<parsed> requests;
  ur::http_read_state end = ur::http_read_state::head;
  unsigned status = 0;
};

// Feeds `segments` (bytes, arrival time) to one reader, starting the next request after each
// complete one, checking the invariants; ends with end_of_input unless it stopped before.
outcome drive(const ur::http_read_limits& lim, const std::vector<std::pair<std::string, clock_type::time_point>>& segments) {
  outcome out;
  ur::http_request_reader r{lim};
  auto now = clock_type::time_point{} + std::chrono::hours(1);
  r.start(now);
  auto last_deadline = r.deadline();
  auto settle = [&] {
    while (r.state() == ur::http_read_state::complete) {
      auto req = r.take();
      check(req.body().size() <= lim.max_body_bytes);
      out.requests.push_back({std::string(req.method_string()), std::string(req.target()), req.body(), req.version(),
                              req.keep_alive()});
      r.start(now);
      last_deadline = r.deadline();
    }
  };
  for (const auto& [bytes, at] : segments) {
    now = std::max(now, at);
    std::string_view rest = bytes;
    while (!rest.empty() && r.reading()) {
      if (r.expire(now)) break;
      check(r.deadline() >= last_deadline);
      last_deadline = r.deadline();
      const std::size_t n = std::min(rest.size(), r.read_size());
      check(n >= 1);
      r.feed(rest.substr(0, n), now);
      rest.remove_prefix(n);
      if (r.state() == ur::http_read_state::head) check(r.buffered() <= lim.max_header_bytes + 1);
      if (r.state() == ur::http_read_state::body) check(r.buffered() <= 2 * ur::http_request_reader::body_read_size);
      if (r.reading()) check(r.deadline() >= last_deadline);
      if (r.expects_continue()) check(r.state() == ur::http_read_state::body && r.content_length() != std::uint64_t{0});
      settle();
    }
    if (!r.reading()) break;
  }
  if (r.reading()) {
    r.end_of_input();
    settle();
  }
  out.end = r.state();
  out.status = r.status();
  if (out.end == ur::http_read_state::refused) check(out.status == 400 || out.status == 413 || out.status == 431);
  return out;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 4) return 0;
  ur::http_read_limits lim;
  lim.max_header_bytes = 256 + std::size_t{data[0]} * 16;
  lim.max_body_bytes = std::uint64_t{data[1]} * 256;
  lim.min_body_rate = 1.0 + data[2] * 10.0;
  lim.header_timeout = std::chrono::milliseconds(10 * (1 + data[3]));
  std::vector<std::pair<std::string, clock_type::time_point>> timed, at_once;
  std::string all;
  auto t = clock_type::time_point{} + std::chrono::hours(1);
  for (std::size_t i = 4; i + 2 <= size;) {
    const std::size_t len = data[i];
    t += std::chrono::milliseconds(10 * data[i + 1]);
    i += 2;
    const std::size_t take = std::min(len, size - i);
    std::string seg(reinterpret_cast<const char*>(data) + i, take);
    i += take;
    all += seg;
    timed.emplace_back(std::move(seg), t);
  }
  at_once.emplace_back(all, clock_type::time_point{} + std::chrono::hours(1));
  const outcome a = drive(lim, timed), b = drive(lim, at_once);
  // At once, no time passes: nothing times out.
  check(b.end != ur::http_read_state::timed_out);
  check(a.requests.size() <= b.requests.size());
  check(std::equal(a.requests.begin(), a.requests.end(), b.requests.begin()));
  if (a.end == ur::http_read_state::refused && b.end == ur::http_read_state::refused && a.requests.size() == b.requests.size()) {
    // A head both over the limit and malformed may be refused for either, by where the reads
    // ended: Beast scans a whole head at once but a head in pieces only once its end is in.
    const bool both_apply = (a.status == 431 && b.status == 400) || (a.status == 400 && b.status == 431);
    check(a.status == b.status || both_apply);
  }
  if (a.end != ur::http_read_state::timed_out) {
    // Without a timeout the split changes nothing, except when an error is seen: Beast finds one
    // in a request line that came in pieces only once the head's end (CRLF CRLF) is in, so input
    // that ends first is `closed` split and `refused` whole (neither is answered with a request).
    check(a.requests.size() == b.requests.size());
    const bool error_timing = (a.end == ur::http_read_state::closed && b.end == ur::http_read_state::refused) ||
                              (a.end == ur::http_read_state::refused && b.end == ur::http_read_state::closed);
    check(a.end == b.end || error_timing);
  }
  return 0;
}
