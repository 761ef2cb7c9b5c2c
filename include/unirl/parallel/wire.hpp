#pragma once
/// \file wire.hpp
/// A scored rollout batch as one byte tensor, for the c10d rollout transport: the rewards, the
/// policy version, then every reflected member of the batch (core/batch.hpp) by name — tensors
/// with their dtype and shape, text and integer lists, scalars. Decoding checks every length,
/// dtype, shape and name against the batch type and throws `unirl::error` naming the field: the
/// bytes come from another process and are not trusted.
///
/// ```cpp
/// torch::Tensor bytes = unirl::parallel::wire::encode(versioned_batch<token_rollout>{b, rewards, 3});
/// auto back = unirl::parallel::wire::decode<token_rollout>(bytes, "rank 1");
/// ```
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/concepts/transport.hpp>
#include <unirl/core/error.hpp>

namespace unirl::parallel::wire {

namespace detail {
enum kind : std::uint8_t { undefined_tensor = 0, tensor = 1, strings = 2, int64s = 3, int64 = 4, real = 5, reals = 6,
                           text = 7, boolean = 8 };

inline bool known_dtype(std::int8_t d) {
  switch (static_cast<c10::ScalarType>(d)) {
    case c10::ScalarType::Byte: case c10::ScalarType::Char: case c10::ScalarType::Short: case c10::ScalarType::Int:
    case c10::ScalarType::Long: case c10::ScalarType::Half: case c10::ScalarType::Float: case c10::ScalarType::Double:
    case c10::ScalarType::Bool: case c10::ScalarType::BFloat16: return true;
    default: return false;
  }
}

struct writer {
  std::vector<std::uint8_t> out;
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <class T>
  void pod(T v) { bytes(&v, sizeof(T)); }
  void str(const std::string& s) {
    pod<std::int64_t>(static_cast<std::int64_t>(s.size()));
    bytes(s.data(), s.size());
  }
  void field(const std::string& name, const torch::Tensor& t) {
    str(name);
    if (!t.defined()) return pod<std::uint8_t>(undefined_tensor);
    pod<std::uint8_t>(tensor);
    const auto c = t.detach().to(torch::kCPU).contiguous();
    pod<std::int8_t>(static_cast<std::int8_t>(c.scalar_type()));
    pod<std::int64_t>(c.dim());
    for (auto d : c.sizes()) pod<std::int64_t>(d);
    bytes(c.data_ptr(), static_cast<std::size_t>(c.nbytes()));
  }
  void field(const std::string& name, const std::vector<std::string>& v) {
    str(name);
    pod<std::uint8_t>(strings);
    pod<std::int64_t>(static_cast<std::int64_t>(v.size()));
    for (const auto& s : v) str(s);
  }
  void field(const std::string& name, const std::vector<std::int64_t>& v) {
    str(name);
    pod<std::uint8_t>(int64s);
    pod<std::int64_t>(static_cast<std::int64_t>(v.size()));
    bytes(v.data(), v.size() * sizeof(std::int64_t));
  }
  void field(const std::string& name, const std::vector<double>& v) {
    str(name);
    pod<std::uint8_t>(reals);
    pod<std::int64_t>(static_cast<std::int64_t>(v.size()));
    bytes(v.data(), v.size() * sizeof(double));
  }
  void field(const std::string& name, std::int64_t v) { str(name), pod<std::uint8_t>(int64), pod(v); }
  void field(const std::string& name, double v) { str(name), pod<std::uint8_t>(real), pod(v); }
  void field(const std::string& name, bool v) { str(name), pod<std::uint8_t>(boolean), pod<std::uint8_t>(v ? 1 : 0); }
  void field(const std::string& name, const std::string& v) { str(name), pod<std::uint8_t>(text), str(v); }
};

struct reader {
  const std::uint8_t* p;
  std::size_t n, at = 0;
  std::string who;
  void need(std::size_t k, const std::string& what) const {
    UNIRL_CHECK(k <= n - at, "wire: batch from ", who, ": ", what, " needs ", k, " bytes at offset ", at, " but only ",
                n - at, " remain: expected a complete encoded batch");
  }
  void bytes(void* dst, std::size_t k, const std::string& what) {
    need(k, what);
    if (k) std::memcpy(dst, p + at, k);
    at += k;
  }
  template <class T>
  T pod(const std::string& what) {
    T v{};
    bytes(&v, sizeof(T), what);
    return v;
  }
  std::int64_t count(const std::string& what, std::size_t unit) {
    const auto c = pod<std::int64_t>(what);
    UNIRL_CHECK(c >= 0 && static_cast<std::uint64_t>(c) <= (n - at) / std::max<std::size_t>(unit, 1),
                "wire: batch from ", who, ": ", what, " = ", c, ": expected a count in [0, ",
                (n - at) / std::max<std::size_t>(unit, 1), "] (the bytes that remain)");
    return c;
  }
  std::string str(const std::string& what) {
    const auto len = count(what + " length", 1);
    std::string s(static_cast<std::size_t>(len), '\0');
    bytes(s.data(), s.size(), what);
    return s;
  }
  std::uint8_t header(const std::string& name) {
    const std::string got = str("field name");
    UNIRL_CHECK(got == name, "wire: batch from ", who, ": field '", got, "' where '", name,
                "' was expected (the samplers and the learner must share the batch type)");
    return pod<std::uint8_t>("field '" + name + "' kind");
  }
  void expect(std::uint8_t k, std::uint8_t want, const std::string& name) {
    UNIRL_CHECK(k == want, "wire: batch from ", who, ": field '", name, "' has kind ", int(k), ": expected ", int(want));
  }
  void field(const std::string& name, torch::Tensor& t) {
    const auto k = header(name);
    if (k == undefined_tensor) return void(t = torch::Tensor());
    expect(k, tensor, name);
    const auto d = pod<std::int8_t>("dtype of '" + name + "'");
    UNIRL_CHECK(known_dtype(d), "wire: batch from ", who, ": field '", name, "' has dtype code ", int(d),
                ": expected a numeric or bool dtype");
    const auto dim = count("rank of '" + name + "'", sizeof(std::int64_t));
    UNIRL_CHECK(dim <= 16, "wire: batch from ", who, ": field '", name, "' has ", dim, " dimensions: expected <= 16");
    std::vector<std::int64_t> shape(static_cast<std::size_t>(dim));
    const auto dtype = static_cast<c10::ScalarType>(d);
    const std::size_t item = c10::elementSize(dtype);
    std::size_t numel = 1;
    for (auto& s : shape) {
      s = pod<std::int64_t>("shape of '" + name + "'");
      UNIRL_CHECK(s >= 0 && (s == 0 || numel <= (n - at) / static_cast<std::size_t>(s)), "wire: batch from ", who,
                  ": field '", name, "' has a dimension of ", s, ": expected a size that fits the ", n - at,
                  " bytes that remain");
      numel *= static_cast<std::size_t>(s);
    }
    need(numel * item, "tensor '" + name + "'");
    t = torch::empty(shape, torch::TensorOptions(dtype));
    bytes(t.data_ptr(), numel * item, "tensor '" + name + "'");
  }
  void field(const std::string& name, std::vector<std::string>& v) {
    expect(header(name), strings, name);
    const auto c = count("entries of '" + name + "'", sizeof(std::int64_t));
    v.clear();
    for (std::int64_t i = 0; i < c; ++i) v.push_back(str("'" + name + "' entry"));
  }
  template <class T>
  void list(const std::string& name, std::vector<T>& v, std::uint8_t want) {
    expect(header(name), want, name);
    const auto c = count("entries of '" + name + "'", sizeof(T));
    v.assign(static_cast<std::size_t>(c), T{});
    bytes(v.data(), v.size() * sizeof(T), "'" + name + "'");
  }
  void field(const std::string& name, std::vector<std::int64_t>& v) { list(name, v, int64s); }
  void field(const std::string& name, std::vector<double>& v) { list(name, v, reals); }
  void field(const std::string& name, std::int64_t& v) { expect(header(name), int64, name), v = pod<std::int64_t>(name); }
  void field(const std::string& name, double& v) { expect(header(name), real, name), v = pod<double>(name); }
  void field(const std::string& name, bool& v) {
    expect(header(name), boolean, name);
    const auto b = pod<std::uint8_t>(name);
    UNIRL_CHECK(b <= 1, "wire: batch from ", who, ": field '", name, "' = ", int(b), ": expected 0 or 1");
    v = b == 1;
  }
  void field(const std::string& name, std::string& v) { expect(header(name), text, name), v = str(name); }
};

template <class M>
inline constexpr bool encodable =
    std::is_same_v<M, torch::Tensor> || std::is_same_v<M, std::vector<std::string>> ||
    std::is_same_v<M, std::vector<std::int64_t>> || std::is_same_v<M, std::vector<double>> ||
    std::is_same_v<M, std::int64_t> || std::is_same_v<M, double> || std::is_same_v<M, bool> ||
    std::is_same_v<M, std::string>;

inline constexpr std::uint32_t magic = 0x31425255;  // "URB1"
}  // namespace detail

/// `b` as a 1-D uint8 tensor (on the CPU).
template <class Batch>
torch::Tensor encode(const versioned_batch<Batch>& b) {
  static_assert(boost::hana::Struct<Batch>::value,
                "unirl::parallel::wire: the batch type must be reflected (BOOST_HANA_ADAPT_STRUCT, core/batch.hpp)");
  detail::writer w;
  w.pod(detail::magic);
  w.pod<std::int64_t>(b.policy_version);
  w.field("rewards", b.rewards);
  boost::hana::for_each(boost::hana::accessors<Batch>(), [&](auto pair) {
    using M = std::remove_cvref_t<decltype(boost::hana::second(pair)(b.batch))>;
    static_assert(detail::encodable<M>,
                  "unirl::parallel::wire: a batch member has a type the wire cannot carry: expected torch::Tensor, "
                  "std::vector<std::string|std::int64_t|double>, std::int64_t, double, bool or std::string");
    w.field(boost::hana::to<const char*>(boost::hana::first(pair)), boost::hana::second(pair)(b.batch));
  });
  auto out = torch::empty({static_cast<std::int64_t>(w.out.size())}, torch::kUInt8);
  if (!w.out.empty()) std::memcpy(out.data_ptr(), w.out.data(), w.out.size());
  return out;
}

/// The batch `encode` wrote; `who` names the sender in errors. Throws `unirl::error` for bytes
/// that are not a complete encoding of a `Batch`.
template <class Batch>
versioned_batch<Batch> decode(const torch::Tensor& bytes, const std::string& who) {
  static_assert(boost::hana::Struct<Batch>::value,
                "unirl::parallel::wire: the batch type must be reflected (BOOST_HANA_ADAPT_STRUCT, core/batch.hpp)");
  UNIRL_CHECK(bytes.defined() && bytes.dim() == 1 && bytes.scalar_type() == torch::kUInt8,
              "wire: batch from ", who, ": expected a 1-D uint8 tensor");
  const auto c = bytes.to(torch::kCPU).contiguous();
  detail::reader r{c.data_ptr<std::uint8_t>(), static_cast<std::size_t>(c.numel()), 0, who};
  const auto m = r.pod<std::uint32_t>("magic");
  UNIRL_CHECK(m == detail::magic, "wire: batch from ", who, ": starts with ", m, ": expected ", detail::magic,
              " (an encoded rollout batch)");
  versioned_batch<Batch> out;
  out.policy_version = r.pod<std::int64_t>("policy_version");
  UNIRL_CHECK(out.policy_version >= 0, "wire: batch from ", who, ": policy_version = ", out.policy_version,
              ": expected >= 0");
  r.field("rewards", out.rewards);
  boost::hana::for_each(boost::hana::accessors<Batch>(), [&](auto pair) {
    r.field(boost::hana::to<const char*>(boost::hana::first(pair)), boost::hana::second(pair)(out.batch));
  });
  UNIRL_CHECK(r.at == r.n, "wire: batch from ", who, ": ", r.n - r.at, " bytes after the last field: expected none");
  return out;
}

}  // namespace unirl::parallel::wire
