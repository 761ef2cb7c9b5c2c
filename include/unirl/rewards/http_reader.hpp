#pragma once
/// \file http_reader.hpp
/// The request side of one HTTP/1.1 connection as a state machine without I/O: bytes and the
/// time they arrived go in, a parsed request (or the reason to refuse or drop the connection) and
/// the deadline of the next byte come out. `json_http_server` (server.hpp) runs one per
/// connection on its event loop; the fuzz target `tests/fuzz/fuzz_http_reader.cpp` drives it
/// directly.
///
/// ```cpp
/// unirl::rewards::http_request_reader r{{.max_header_bytes = 16384, .max_body_bytes = 1 << 20}};
/// r.start(now);
/// r.feed("GET /health HTTP/1.1\r\nHost: x\r\n\r\n", now);
/// if (r.state() == unirl::rewards::http_read_state::complete) handle(r.take());
/// if (now >= r.deadline()) drop_connection();   // a header too slow, or a body below min_body_rate
/// ```
/// Limits: the head (request line and header fields) of at most `max_header_bytes` (beyond: 431),
/// within `header_timeout` of `start` (idle keep-alive time included); a body of at most
/// `max_body_bytes` (beyond: 413, from Content-Length before any body byte), then arriving at
/// `min_body_rate` bytes per second on average after a grace of `header_timeout`, with no silence
/// longer than `header_timeout`. The reader holds at most `read_size()` unparsed bytes.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <boost/asio/buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

namespace unirl::rewards {

/// Where a request being read stands.
enum class http_read_state {
  head,       // waiting for (the rest of) the request line and header fields
  body,       // the head is in; reading the body
  complete,   // a whole request is parsed: take() it
  refused,    // malformed or over a limit: answer status() with reason(), then close
  timed_out,  // past deadline(): close without an answer
  closed,     // the peer closed (before a byte of this request, or in its middle): close
};

/// The limits of `http_request_reader`.
struct http_read_limits {
  std::size_t max_header_bytes = 16 << 10;     // request line + header fields; beyond: 431
  std::uint64_t max_body_bytes = 16ull << 20;  // beyond: 413, from Content-Length before the body is read
  std::chrono::steady_clock::duration header_timeout = std::chrono::seconds(10);  // the head within this of start()
  double min_body_rate = 1024;                 // body bytes per second on average, after header_timeout of grace
};

/// One connection's request reader (see the file comment). Not thread-safe: one connection, one
/// strand.
class http_request_reader {
 public:
  using clock = std::chrono::steady_clock;
  using request = boost::beast::http::request<boost::beast::http::string_body>;
  /// The largest read the body phase asks for (and so the most unparsed bytes held then).
  static constexpr std::size_t body_read_size = 64 << 10;

  explicit http_request_reader(http_read_limits l) : limits_(l) {}

  /// Begins a request at `now` (a new connection, or a keep-alive one after its reply). Bytes
  /// of a pipelined next request that arrived with the previous one are parsed at once.
  void start(clock::time_point now) {
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(std::min<std::size_t>(limits_.max_header_bytes, UINT32_MAX)));
    parser_->body_limit(limits_.max_body_bytes);
    state_ = http_read_state::head;
    status_ = 0;
    reason_.clear();
    started_ = last_byte_ = head_done_ = now;
    head_bytes_ = body_bytes_ = 0;
    got_bytes_ = !pending_.empty();
    parse();
  }

  /// Parses `bytes`, received at `now` (each at most `read_size()` long: the buffer stays
  /// bounded). Ignored unless reading (head or body).
  void feed(std::string_view bytes, clock::time_point now) {
    if (!reading() || bytes.empty()) return;
    got_bytes_ = true;
    last_byte_ = now;
    pending_.append(bytes);
    parse();
  }

  /// The peer closed its side (or reset) at `now`.
  void end_of_input() {
    if (!reading()) return;
    if (state_ == http_read_state::head && !got_bytes_) {
      state_ = http_read_state::closed;  // between requests: an ordinary end
      return;
    }
    boost::beast::error_code ec;
    if (state_ == http_read_state::body) parser_->put_eof(ec);
    if (!ec && parser_->is_done()) {
      state_ = http_read_state::complete;  // (a request's body never ends at EOF: Content-Length or chunked)
      return;
    }
    state_ = http_read_state::closed;  // a partial request: nothing to answer
  }

  /// The time by which more bytes must arrive (see the file comment); `time_point::max()` once
  /// the reader no longer reads.
  clock::time_point deadline() const {
    if (state_ == http_read_state::head) return started_ + limits_.header_timeout;
    if (state_ != http_read_state::body) return clock::time_point::max();
    const auto by_rate = head_done_ + limits_.header_timeout +
                         std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(
                             static_cast<double>(body_bytes_) / limits_.min_body_rate));
    return std::min(last_byte_ + limits_.header_timeout, by_rate);
  }

  /// Marks the reader timed out when `now` is past `deadline()`; returns whether it did.
  bool expire(clock::time_point now) {
    if (!reading() || now < deadline()) return false;
    state_ = http_read_state::timed_out;
    return true;
  }

  /// How many bytes the next read may take: the head's remaining room (so that at most
  /// `max_header_bytes` + 1 of it are held), else `body_read_size`.
  std::size_t read_size() const {
    if (state_ == http_read_state::head) return limits_.max_header_bytes + 1 - std::min(pending_.size(), limits_.max_header_bytes);
    return body_read_size;
  }

  http_read_state state() const { return state_; }
  bool reading() const { return state_ == http_read_state::head || state_ == http_read_state::body; }
  /// The status to answer when `refused`: 400, 413 or 431.
  unsigned status() const { return status_; }
  /// Why it was refused, one line.
  const std::string& reason() const { return reason_; }
  /// The HTTP version to answer with (the request's, once its line is parsed; else 1.1).
  unsigned version() const { return parser_ && parser_->get().version() != 0 ? parser_->get().version() : 11; }
  /// The declared body length, once the head is in (empty when chunked, 0 without a body).
  std::optional<std::uint64_t> content_length() const {
    if (!parser_ || !parser_->is_header_done()) return std::nullopt;
    if (parser_->chunked()) return std::nullopt;
    return parser_->content_length().value_or(0);
  }
  /// Whether the head asks for `100 Continue` before the body (`Expect: 100-continue`, as curl
  /// sends for large bodies), and no body byte has come yet.
  bool expects_continue() const {
    if (state_ != http_read_state::body || body_bytes_ != 0 || !parser_) return false;
    return boost::beast::iequals(parser_->get()[boost::beast::http::field::expect], "100-continue");
  }
  /// Unparsed bytes held (those of a pipelined next request included).
  std::size_t buffered() const { return pending_.size(); }
  /// When the head was complete.
  clock::time_point head_done() const { return head_done_; }

  /// The complete request (once `complete`); call `start` for the next one.
  request take() {
    request r = parser_->release();
    parser_.reset();
    state_ = http_read_state::head;  // until start(): nothing is read
    return r;
  }

 private:
  void parse() {
    namespace http = boost::beast::http;
    while (reading() && !pending_.empty()) {
      boost::beast::error_code ec;
      const std::size_t used = parser_->put(boost::asio::buffer(pending_.data(), pending_.size()), ec);
      if (state_ == http_read_state::head) head_bytes_ += used;
      else body_bytes_ += used;
      pending_.erase(0, used);
      if (ec == http::error::need_more) ec = {};
      if (state_ == http_read_state::head) {
        // Beast bounds the request line and the fields each; the limit is on both together, and
        // checked before Beast's own errors (413 from Content-Length, 400), so that a head over
        // it is refused alike however its bytes arrive.
        // (Bytes still held count while the head is incomplete; after an error, what Beast
        // consumed is the head.)
        const bool incomplete = !ec && !parser_->is_header_done();
        if (head_bytes_ + (incomplete ? pending_.size() : 0) > limits_.max_header_bytes)
          return refuse(http::error::header_limit);
      }
      if (ec) return refuse(ec);
      if (state_ == http_read_state::head && parser_->is_header_done()) {
        state_ = http_read_state::body;
        head_done_ = last_byte_;
      }
      if (parser_->is_done()) {
        state_ = http_read_state::complete;
        return;
      }
      if (used == 0) return;  // needs more bytes
    }
    // A head with no body is done as soon as it is parsed.
    if (state_ == http_read_state::body && parser_->is_done()) state_ = http_read_state::complete;
  }

  void refuse(boost::beast::error_code ec) {
    namespace http = boost::beast::http;
    state_ = http_read_state::refused;
    if (ec == http::error::body_limit) {
      status_ = 413;
      reason_ = "request body larger than max_body_bytes = " + std::to_string(limits_.max_body_bytes) +
                " bytes; send smaller batches (the client's chunk_size) or raise the server's limit";
    } else if (ec == http::error::header_limit) {
      status_ = 431;
      reason_ = "request line and header fields larger than max_header_bytes = " + std::to_string(limits_.max_header_bytes) +
                " bytes";
    } else {
      status_ = 400;
      reason_ = "malformed HTTP request: " + ec.message();
    }
    pending_.clear();
  }

  http_read_limits limits_;
  std::optional<boost::beast::http::request_parser<boost::beast::http::string_body>> parser_;
  std::string pending_;
  http_read_state state_ = http_read_state::head;
  unsigned status_ = 0;
  std::string reason_;
  clock::time_point started_{}, last_byte_{}, head_done_{};
  std::uint64_t head_bytes_ = 0, body_bytes_ = 0;
  bool got_bytes_ = false;
};

}  // namespace unirl::rewards
