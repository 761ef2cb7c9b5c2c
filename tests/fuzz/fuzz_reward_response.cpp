// Fuzz target (mutation driver, see scripts/fuzz.sh): what a reward service answers — the raw bytes of an HTTP/1.1 response (status
// line, headers, Content-Length or chunked body) as remote.hpp's client reads them.
//   bash scripts/fuzz.sh reward_response 60
// A loopback server thread (127.0.0.1, ephemeral port) answers every request with the input's
// bytes after the first and closes. The first byte picks the client and the batch size n:
//   even: unirl::rewards::http_post, then parse_rewards(body, n) on what it returns (with the
//         components map), parse_retry_after on its Retry-After and parse_url on its Location;
//   odd:  a whole remote_scorer call on a batch of n completions (no retries, no redirects), the
//         path a trainer takes, error bodies included.
// Only unirl::error may leave them; rewards that are accepted must be n finite float32.
// unirl-fuzz: links unirl::unirl
// unirl-fuzz: includes LibTorch (built with g++ and the mutation driver, see scripts/fuzz.sh)
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/rewards/remote.hpp>

namespace {
namespace net = boost::asio;
using tcp = net::ip::tcp;

// Serves `reply` to each connection in turn: reads the request (head and Content-Length body),
// writes the reply, shuts its side down and waits for the client to close.
class canned_server {
 public:
  canned_server() : acceptor_(ioc_, tcp::endpoint(net::ip::make_address("127.0.0.1"), 0)) {
    port_ = acceptor_.local_endpoint().port();
    thread_ = std::thread([this] { run(); });
    thread_.detach();  // lives as long as the fuzzing process
  }
  void set_reply(std::string r) {
    std::lock_guard lock(mutex_);
    reply_ = std::move(r);
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_) + "/score"; }

 private:
  void run() {
    for (;;) {
      boost::system::error_code ec;
      tcp::socket s(ioc_);
      acceptor_.accept(s, ec);
      if (ec) continue;
      std::string req;
      char buf[4096];
      std::size_t need = std::string::npos;
      while (need == std::string::npos || req.size() < need) {
        const auto n = s.read_some(net::buffer(buf), ec);
        if (ec) break;
        req.append(buf, n);
        const auto head = req.find("\r\n\r\n");
        if (need == std::string::npos && head != std::string::npos) {
          std::size_t len = 0;
          const auto cl = req.find("Content-Length: ");
          if (cl != std::string::npos && cl < head) len = std::stoul(req.substr(cl + 16));
          need = head + 4 + len;
        }
      }
      std::string reply;
      {
        std::lock_guard lock(mutex_);
        reply = reply_;
      }
      net::write(s, net::buffer(reply), ec);
      s.shutdown(tcp::socket::shutdown_send, ec);
      while (!ec) s.read_some(net::buffer(buf), ec);  // until the client closes
    }
  }
  net::io_context ioc_;
  tcp::acceptor acceptor_;
  std::uint16_t port_ = 0;
  std::thread thread_;
  std::mutex mutex_;
  std::string reply_;
};

void check_rewards(const torch::Tensor& r, std::int64_t n) {
  if (r.dim() != 1 || r.numel() != n || r.scalar_type() != torch::kFloat32 || !torch::isfinite(r).all().item<bool>())
    __builtin_trap();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static canned_server server;
  if (size == 0) return 0;
  const std::int64_t n = (data[0] >> 1) % 4;  // 0..3 samples
  server.set_reply(std::string(reinterpret_cast<const char*>(data) + 1, size - 1));
  try {
    if (data[0] % 2 == 0) {
      const auto res = unirl::rewards::http_post(unirl::rewards::parse_url(server.url()), R"({"size": 1})", 5.0,
                                                 "application/json", std::uint64_t{1} << 20);
      if (!res.retry_after.empty()) (void)unirl::rewards::detail::parse_retry_after(res.retry_after);
      if (!res.location.empty()) {
        try {
          (void)unirl::rewards::parse_url(res.location);
        } catch (const unirl::error&) {
        }
      }
      std::map<std::string, double> components;
      check_rewards(unirl::rewards::parse_rewards(res.body, n, &components), n);
    } else {
      unirl::rewards::remote_scorer remote{{.url = server.url(), .timeout_s = 5, .retries = 0, .deadline_s = 5}};
      unirl::rewards::json_batch b;
      b.count = n;
      for (std::int64_t i = 0; i < n; ++i) b.completions.push_back("c" + std::to_string(i));
      check_rewards(remote(b), n);
    }
  } catch (const unirl::error&) {
  }
  return 0;
}
