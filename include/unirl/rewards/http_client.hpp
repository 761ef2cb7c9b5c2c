#pragma once
/// \file http_client.hpp
/// The client side of the JSON services over HTTP/1.1 (Boost.Beast), without LibTorch: URLs,
/// one POST (or GET) with a deadline, and the helpers that keep bytes from the network out of
/// error messages. `remote_scorer` (remote.hpp) and `agents::remote_environment` send with it.
///
/// ```cpp
/// const auto u = unirl::rewards::parse_url("http://127.0.0.1:8000/score");
/// const auto r = unirl::rewards::http_post(u, R"({"size": 0})", /*timeout_s=*/5.0);
/// if (r.status != 200) throw std::runtime_error(unirl::rewards::detail::excerpt(r.body));
/// ```
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <time.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <unirl/core/error.hpp>

namespace unirl::rewards {

/// The parts of an http:// URL.
struct parsed_url {
  std::string host, port, target;
};

/// Splits `http://host[:port][/path]`; throws `config_error` naming the URL when it is not one.
inline parsed_url parse_url(const std::string& url) {
  const std::string scheme = "http://";
  if (url.rfind(scheme, 0) != 0) throw config_error("url", "'" + url + "' is not an http:// URL");
  const auto rest = url.substr(scheme.size());
  const auto slash = rest.find('/');
  const auto authority = rest.substr(0, slash);
  parsed_url u;
  u.target = slash == std::string::npos ? "/" : rest.substr(slash);
  const auto colon = authority.rfind(':');
  if (colon == std::string::npos) {
    u.host = authority;
    u.port = "80";
  } else {
    u.host = authority.substr(0, colon);
    u.port = authority.substr(colon + 1);
  }
  if (u.host.empty() || u.port.empty() || u.port.find_first_not_of("0123456789") != std::string::npos)
    throw config_error("url", "'" + url + "' has no valid host[:port]");
  return u;
}

/// The status, body and the headers the client acts on of one HTTP exchange.
struct http_result {
  unsigned status = 0;
  std::string body;
  std::string location{}, retry_after{}, content_encoding{};
};

namespace detail {
/// A short, printable excerpt of bytes that came from the network: at most `max_chars` of them,
/// every byte outside printable ASCII written as `\xNN` (`\n`, `\r`, `\t`, `\\` as such), and
/// the total length when cut — never raw bytes in an error message.
inline std::string excerpt(std::string_view bytes, std::size_t max_chars = 120) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  std::size_t i = 0;
  for (; i < bytes.size() && i < max_chars; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c == '\\') out += "\\\\";
    else if (c >= 0x20 && c < 0x7f) out += static_cast<char>(c);
    else out += std::string{'\\', 'x', hex[c >> 4], hex[c & 15]};
  }
  if (i < bytes.size()) out += "... (" + std::to_string(bytes.size()) + " bytes)";
  return out;
}

/// A failure the same request would meet again (a 4xx other than 408 / 429, a redirect not
/// followed, a response that breaks the schema): `remote_scorer` does not retry it.
struct permanent_error : error {
  using error::error;
};

/// Seconds to wait from a `Retry-After` value (delta-seconds or an HTTP-date); nullopt when it is
/// neither.
inline std::optional<double> parse_retry_after(const std::string& v) {
  const auto b = v.find_first_not_of(" \t"), e = v.find_last_not_of(" \t");
  if (b == std::string::npos) return std::nullopt;
  const auto t = v.substr(b, e - b + 1);
  if (t.find_first_not_of("0123456789") == std::string::npos) {
    if (t.size() > 9) return 1e9;
    return static_cast<double>(std::stol(t));
  }
  std::tm tm{};
  const char* end = ::strptime(t.c_str(), "%a, %d %b %Y %H:%M:%S GMT", &tm);
  if (end == nullptr || *end != '\0') return std::nullopt;
  // In seconds (time_t): a date after 2262 does not fit system_clock's nanoseconds (signed overflow).
  const std::time_t when = ::timegm(&tm);
  return std::max(0.0, std::difftime(when, std::time(nullptr)));
}
}  // namespace detail

/// One HTTP/1.1 exchange (`method` on `u.target`, `body` sent when not empty) with a deadline
/// covering connect, send and the whole response (at most `max_response_bytes` of body); throws
/// `unirl::error` with the cause (timed out, connection refused, closed early, ...).
inline http_result http_exchange(boost::beast::http::verb method, const parsed_url& u, const std::string& body,
                                 double timeout_s, std::string_view content_type = "application/json",
                                 std::uint64_t max_response_bytes = std::uint64_t{64} << 20) {
  namespace beast = boost::beast;
  namespace http = beast::http;
  namespace net = boost::asio;
  using tcp = net::ip::tcp;

  net::io_context ioc;
  tcp::resolver resolver(ioc);
  beast::tcp_stream stream(ioc);
  beast::flat_buffer buffer;
  http::request<http::string_body> req{method, u.target, 11};
  req.set(http::field::host, u.host);
  req.set(http::field::user_agent, "unirl-reward-client");
  if (!body.empty() || method == http::verb::post)
    req.set(http::field::content_type, beast::string_view(content_type.data(), content_type.size()));
  req.keep_alive(false);
  req.body() = body;
  req.prepare_payload();
  http::response_parser<http::string_body> parser;
  parser.body_limit(max_response_bytes);

  beast::error_code failure;
  std::string stage;
  const auto deadline = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  auto fail = [&](beast::error_code ec, const char* where) {
    failure = ec;
    stage = where;
  };
  resolver.async_resolve(u.host, u.port, [&](beast::error_code ec, tcp::resolver::results_type results) {
    if (ec) return fail(ec, "resolving the host");
    stream.expires_after(deadline);
    stream.async_connect(results, [&](beast::error_code ec, const tcp::endpoint&) {
      if (ec) return fail(ec, "connecting");
      http::async_write(stream, req, [&](beast::error_code ec, std::size_t) {
        if (ec) return fail(ec, "sending the request");
        http::async_read(stream, buffer, parser, [&](beast::error_code ec, std::size_t) {
          if (ec) return fail(ec, "reading the response");
          beast::error_code ignored;
          stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
        });
      });
    });
  });
  ioc.run();
  if (failure) {
    if (failure == beast::error::timeout)
      throw error(unirl::detail::concat("timed out after ", timeout_s, " s while ", stage));
    if (failure == net::error::connection_refused) throw error("connection refused");
    if (failure == http::error::body_limit)
      throw error(unirl::detail::concat("the response body is larger than ", max_response_bytes, " bytes"));
    if (failure == http::error::end_of_stream || failure == net::error::eof || failure == net::error::connection_reset ||
        failure == http::error::partial_message)
      throw error("the server closed the connection while " + stage + " (" + failure.message() + ")");
    throw error(stage + " failed: " + failure.message());
  }
  const auto& res = parser.get();
  auto header = [&](http::field f) { return std::string(res[f]); };
  return {res.result_int(), std::move(parser.get().body()), header(http::field::location), header(http::field::retry_after),
          header(http::field::content_encoding)};
}

/// One HTTP/1.1 POST of `body` (see `http_exchange`).
inline http_result http_post(const parsed_url& u, const std::string& body, double timeout_s,
                             std::string_view content_type = "application/json",
                             std::uint64_t max_response_bytes = std::uint64_t{64} << 20) {
  return http_exchange(boost::beast::http::verb::post, u, body, timeout_s, content_type, max_response_bytes);
}

}  // namespace unirl::rewards
