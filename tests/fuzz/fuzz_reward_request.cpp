// Fuzz target (mutation driver, see scripts/fuzz.sh): what a reward server receives — request bodies and raw HTTP/1.1 requests, as
// server.hpp reads them.
//   bash scripts/fuzz.sh reward_request 60
// The first byte picks the path, the rest is its input:
//   even: reward_server::score_body(body) — decode_request (the SAX reader: size, texts, tensors
//         as numbers or base64) and the hosted scorer — in process, fast;
//   odd:  the bytes over a loopback connection to a running reward_server (its HTTP parser, body
//         limit, keep-alive, routing), then the reply is read to the end.
// The server must answer (status 2xx/4xx/5xx, never crash); score_body never throws.
// unirl-fuzz: links unirl::unirl
// unirl-fuzz: includes LibTorch (built with g++ and the mutation driver, see scripts/fuzz.sh)
#include <cstddef>
#include <cstdint>
#include <string>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/rewards/remote.hpp>
#include <unirl/rewards/server.hpp>

namespace {
// Touches every field the decoder fills and scores 1 per sample.
struct touch_all {
  torch::Tensor operator()(const unirl::rewards::json_batch& b) const {
    std::size_t chars = 0;
    for (const auto* v : {&b.completions, &b.references, &b.prompts})
      for (const auto& s : *v) chars += s.size();
    for (const auto& [k, t] : b.tensors) (void)t.sum().item<double>();
    (void)chars;
    return torch::ones({b.size()});
  }
};

unirl::rewards::reward_server<touch_all>& server() {
  static auto* s = [] {
    auto* p = new unirl::rewards::reward_server<touch_all>(
        touch_all{}, {.max_body_bytes = 1 << 16, .max_connections = 4, .threads = 1, .read_timeout_s = 2,
                      .write_timeout_s = 2, .log_errors = false});
    p->start();
    return p;
  }();
  return *s;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto& srv = server();
  if (data[0] % 2 == 0) {
    const auto r = srv.score_body(rest);
    if (r.status != 200 && r.status != 400 && r.status != 500) __builtin_trap();
    if (r.status == 200) {
      // Accepted: the reply is the JSON the client's parse_rewards reads back.
      const auto j = nlohmann::json::parse(r.body);
      if (!j.contains("rewards") || !j["rewards"].is_array()) __builtin_trap();
    }
    return 0;
  }
  namespace net = boost::asio;
  net::io_context ioc;
  net::ip::tcp::socket s(ioc);
  boost::system::error_code ec;
  s.connect({net::ip::make_address("127.0.0.1"), srv.port()}, ec);
  if (ec) __builtin_trap();  // the server stopped accepting
  net::write(s, net::buffer(rest), ec);
  s.shutdown(net::ip::tcp::socket::shutdown_send, ec);
  char buf[4096];
  ec = {};
  while (!ec) s.read_some(net::buffer(buf), ec);  // until the server closes (read timeout 2 s at most)
  return 0;
}
