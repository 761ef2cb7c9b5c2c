#pragma once
/// \file batch.hpp
/// Rollout batches that reflect their fields. A batch is a plain struct adapted with
/// `BOOST_HANA_ADAPT_STRUCT` (every member, in declaration order); `select`, `trim`, `concat`
/// and `to` are written once here over its members, so a new field costs one line in the struct
/// and one name in the adaptation — and forgetting the name is a compile error, not a field that
/// a minibatch silently drops.
///
/// ```cpp
/// struct my_batch {
///   torch::Tensor images;               // (B, C, H, W)  per sample: row i is sample i
///   std::vector<std::string> captions;  // (B) per sample (or empty)
///   torch::Tensor palette;              // (K, 3) the same for every sample
///   std::int64_t policy_version = 0;    // which weights drew the batch
///   using shared_fields = unirl::batch::fields<"palette", "policy_version">;
///   std::int64_t size() const { return images.defined() ? images.size(0) : 0; }
///   my_batch select(const torch::Tensor& index) const { return unirl::batch::select(*this, index); }
/// };
/// BOOST_HANA_ADAPT_STRUCT(my_batch, images, captions, palette, policy_version);
///
/// auto mb = unirl::batch::select(b, torch::tensor({3, 0}));    // images (2, C, H, W), captions {3, 0}
/// auto all = unirl::batch::concat(std::vector<my_batch>{b, mb}); // palette checked equal, kept once
/// auto gpu = unirl::batch::to(b, torch::kCUDA);                 // every tensor member moved
/// ```
///
/// What each member is — the tag rule:
/// | member | by default | `select(index)` | `trim()` | `concat(parts)` | `to(device)` |
/// |---|---|---|---|---|---|
/// | `torch::Tensor` | per sample, batch dimension 0 | rows `index` | kept (or sliced, see below) | `cat` on dim 0 | moved |
/// | `std::vector<T>` | per sample, one entry per sample, or empty | entries `index` (empty stays empty) | kept | appended | copied |
/// | named in `using shared_fields = fields<...>` | the same for every sample (a scalar, a shared tensor) | copied | copied | checked equal, kept once | tensors moved |
/// | named in `using layout_fields = fields<...>` | describes the batch as collected (a (T, N) grid, bootstrap values) | reset to `{}` | copied | reset to `{}` | tensors moved |
///
/// Any other member type (an integer, a string, a struct) must be named in `shared_fields` or
/// `layout_fields`: a member nobody classified does not compile. An undefined tensor stays
/// undefined through every operation; `concat` rejects parts that disagree on whether a member
/// is defined (or empty), naming the member.
///
/// Ragged columns. Token batches pad a second axis (prompts on the left, completions on the
/// right); `using ragged_columns = column_groups<columns<pad_side::left, "prompt_mask",
/// "prompt_ids">, ...>` declares each group by its mask (the first name, float or bool, > 0 on
/// real columns) and the members aligned with it on dimension 1. `trim` drops the columns that
/// are padding in every row (keeping at least one per group); `concat` pads each part's group to
/// the widest part on the group's side, with `fill(member name)` (0 by default).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana.hpp>
#include <torch/torch.h>

#include <unirl/core/error.hpp>
#include <unirl/core/host.hpp>

namespace unirl::batch {

/// A member name as a template argument: `fields<"next_value", "num_envs">`.
template <std::size_t N>
struct name {
  char text[N]{};
  constexpr name(const char (&s)[N]) {  // NOLINT: implicit on purpose (string literal arguments)
    for (std::size_t i = 0; i < N; ++i) text[i] = s[i];
  }
  constexpr std::string_view view() const { return {text, N - 1}; }
};

/// A list of member names of a batch (see the file comment).
template <name... Names>
struct fields {
  static constexpr std::array<std::string_view, sizeof...(Names)> names{Names.view()...};
  static constexpr bool contains(std::string_view n) {
    for (auto m : names)
      if (m == n) return true;
    return false;
  }
};

/// The side a ragged column group is padded on.
enum class pad_side { left, right };

/// A ragged column group: `Mask` ((B, W) float or bool, > 0 on real columns) and the members
/// aligned with it on dimension 1 ((B, W, ...)); padded on `Side`.
template <pad_side Side, name Mask, name... Members>
struct columns {
  static constexpr pad_side side = Side;
  static constexpr std::string_view mask = Mask.view();
  using members = fields<Mask, Members...>;
};

/// The ragged column groups of a batch: `column_groups<columns<...>, columns<...>>`.
template <class... Groups>
struct column_groups {};

namespace detail {

template <class B>
struct shared_of { using type = fields<>; };
template <class B>
  requires requires { typename B::shared_fields; }
struct shared_of<B> { using type = typename B::shared_fields; };

template <class B>
struct layout_of { using type = fields<>; };
template <class B>
  requires requires { typename B::layout_fields; }
struct layout_of<B> { using type = typename B::layout_fields; };

template <class B>
struct ragged_of { using type = column_groups<>; };
template <class B>
  requires requires { typename B::ragged_columns; }
struct ragged_of<B> { using type = typename B::ragged_columns; };

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};

// The name of the member an accessor pair describes, as a constant.
template <class Pair>
constexpr std::string_view member_name() {
  using key = std::remove_cvref_t<decltype(boost::hana::first(std::declval<Pair>()))>;
  return std::string_view{key::c_str()};
}

template <class B, class Pair>
using member_t = std::remove_cvref_t<decltype(boost::hana::second(std::declval<Pair>())(std::declval<B&>()))>;

template <class Pair>
using pair_t = std::remove_cvref_t<Pair>;

// Where a member is aligned in a ragged group: the group's index, or -1.
template <class Groups>
struct group_table;
template <class... G>
struct group_table<column_groups<G...>> {
  static constexpr std::size_t count = sizeof...(G);
  static constexpr int group_of(std::string_view n) {
    int i = 0;
    const bool found = ((G::members::contains(n) || (++i, false)) || ...);
    return found ? i : -1;
  }
  static constexpr std::array<std::string_view, sizeof...(G)> masks{G::mask...};
  static constexpr std::array<pad_side, sizeof...(G)> sides{G::side...};
  // Every name of every group.
  template <class F>
  static constexpr bool all_names(F&& f) {
    return (std::all_of(G::members::names.begin(), G::members::names.end(), f) && ...);
  }
};

enum class role { per_sample_tensor, per_sample_vector, shared, layout };

template <class B, class Pair>
constexpr role role_of() {
  constexpr auto n = member_name<Pair>();
  using M = member_t<B, Pair>;
  if (layout_of<B>::type::contains(n)) return role::layout;
  if (shared_of<B>::type::contains(n)) return role::shared;
  if constexpr (std::is_same_v<M, torch::Tensor>) return role::per_sample_tensor;
  else if constexpr (is_vector<M>::value) return role::per_sample_vector;
  else return role::shared;  // rejected by check() unless listed: see there
}

// Size of a struct with exactly the adapted members, laid out in their order.
template <class B>
constexpr std::size_t adapted_size() {
  return boost::hana::unpack(boost::hana::accessors<B>(), [](auto... pairs) {
    constexpr std::array<std::size_t, sizeof...(pairs)> sizes{sizeof(member_t<B, decltype(pairs)>)...};
    constexpr std::array<std::size_t, sizeof...(pairs)> aligns{alignof(member_t<B, decltype(pairs)>)...};
    std::size_t off = 0, align = 1;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      off = (off + aligns[i] - 1) / aligns[i] * aligns[i] + sizes[i];
      align = std::max(align, aligns[i]);
    }
    return (off + align - 1) / align * align;
  });
}

template <class B>
constexpr bool has_member(std::string_view n) {
  return boost::hana::unpack(boost::hana::accessors<B>(), [n](auto... pairs) {
    return ((member_name<decltype(pairs)>() == n) || ...);
  });
}

template <class B>
constexpr bool is_tensor_member(std::string_view n) {
  return boost::hana::unpack(boost::hana::accessors<B>(), [n](auto... pairs) {
    return ((member_name<decltype(pairs)>() == n && std::is_same_v<member_t<B, decltype(pairs)>, torch::Tensor>) ||
            ...);
  });
}

template <class B>
constexpr bool names_members(auto names) {
  for (auto n : names)
    if (!has_member<B>(n)) return false;
  return true;
}

template <class B>
constexpr bool scalars_classified() {
  return boost::hana::unpack(boost::hana::accessors<B>(), [](auto... pairs) {
    return ((std::is_same_v<member_t<B, decltype(pairs)>, torch::Tensor> ||
             is_vector<member_t<B, decltype(pairs)>>::value ||
             shared_of<B>::type::contains(member_name<decltype(pairs)>()) ||
             layout_of<B>::type::contains(member_name<decltype(pairs)>())) &&
            ...);
  });
}

template <class B>
constexpr bool tags_disjoint() {
  for (auto n : shared_of<B>::type::names)
    if (layout_of<B>::type::contains(n)) return false;
  return true;
}

// Compile-time checks of a reflected batch, each with the message a batch author needs.
template <class B>
constexpr bool check() {
  static_assert(boost::hana::Struct<B>::value,
                "unirl::batch: adapt the batch with BOOST_HANA_ADAPT_STRUCT(type, every member...)");
  static_assert(adapted_size<B>() == sizeof(B),
                "unirl::batch: the batch's BOOST_HANA_ADAPT_STRUCT misses a member (or lists them out of "
                "declaration order): name every member, in order");
  static_assert(names_members<B>(shared_of<B>::type::names),
                "unirl::batch: shared_fields names a member the batch does not have");
  static_assert(names_members<B>(layout_of<B>::type::names),
                "unirl::batch: layout_fields names a member the batch does not have");
  static_assert(tags_disjoint<B>(), "unirl::batch: a member is in both shared_fields and layout_fields");
  static_assert(scalars_classified<B>(),
                "unirl::batch: a member that is neither a torch::Tensor nor a std::vector (a scalar, a string) "
                "must be named in shared_fields (the same for every sample) or layout_fields (describes the "
                "whole batch)");
  static_assert(group_table<typename ragged_of<B>::type>::all_names(
                    [](std::string_view n) { return is_tensor_member<B>(n); }),
                "unirl::batch: ragged_columns names a member that is not a torch::Tensor of the batch");
  return true;
}

// The index on the host. A host index (the trainer's minibatch indices) is read as it is; an
// index on a device costs one host read (counted by `host_reads()`).
inline std::vector<std::int64_t> host_index(const torch::Tensor& idx) {
  if (!idx.is_cpu()) ++::unirl::detail::host_read_counter();
  const auto host = idx.to(torch::kCPU, torch::kInt64).contiguous();
  return {host.data_ptr<std::int64_t>(), host.data_ptr<std::int64_t>() + host.numel()};
}

// Whether each column of a (B, W) column mask holds a real entry in some row: (W,) float, no read.
inline torch::Tensor used_columns(const torch::Tensor& mask, std::string_view mask_name) {
  UNIRL_CHECK(mask.defined() && mask.dim() == 2, "batch::trim: the column mask '", mask_name, "' has sizes ",
              mask.defined() ? mask.sizes() : torch::IntArrayRef{}, "; expected (B, W)");
  return (mask.to(torch::kFloat).sum(0) > 0).to(torch::kFloat);
}

// Columns [begin, end) to keep of a group of `W` columns padded on `side`, given which are used
// (`used[0..W)` read on the host): the all-padding ones on the padded side go, at least one stays.
inline std::pair<std::int64_t, std::int64_t> kept_columns(const double* used, std::int64_t W, pad_side side) {
  if (side == pad_side::left) {
    std::int64_t b = 0;
    while (b < W - 1 && used[b] == 0.0) ++b;
    return {b, W};
  }
  std::int64_t e = W;
  while (e > 1 && used[e - 1] == 0.0) --e;
  return {0, e};
}

}  // namespace detail

/// The samples at `index` ((n,) int64, any device), in order: per-sample tensors by rows,
/// per-sample vectors by entries, shared members copied, layout members reset (see the file comment).
template <class B>
B select(const B& b, const torch::Tensor& index) {
  static_assert(detail::check<B>());
  UNIRL_CHECK(index.defined() && index.dim() == 1, "select: index must be 1-D, got sizes ",
              index.defined() ? index.sizes() : torch::IntArrayRef{});
  const auto idx = index.to(torch::kInt64);
  // The index on each member's device: a host index is copied without waiting for the device
  // (no synchronisation), once per device.
  torch::Tensor idx_on;
  auto index_on = [&](torch::Device d) -> const torch::Tensor& {
    if (!idx_on.defined() || idx_on.device() != d) idx_on = idx.to(d, /*non_blocking=*/idx.is_cpu());
    return idx_on;
  };
  std::vector<std::int64_t> host;
  bool have_host = false;
  B out{};
  boost::hana::for_each(boost::hana::accessors<B>(), [&](auto pair) {
    using P = detail::pair_t<decltype(pair)>;
    constexpr auto role = detail::role_of<B, P>();
    [[maybe_unused]] constexpr auto n = detail::member_name<P>();
    const auto& from = boost::hana::second(pair)(b);
    auto& to = boost::hana::second(pair)(out);
    if constexpr (role == detail::role::per_sample_tensor) {
      to = from.defined() ? from.index_select(0, index_on(from.device())) : torch::Tensor{};
    } else if constexpr (role == detail::role::per_sample_vector) {
      to.clear();
      if (from.empty()) return;
      if (!have_host) host = detail::host_index(idx), have_host = true;
      to.reserve(host.size());
      for (const auto i : host) {
        UNIRL_CHECK(i >= 0 && i < static_cast<std::int64_t>(from.size()), "select: index ", i, " out of range for ",
                    from.size(), " entries of '", n, "'");
        to.push_back(from[static_cast<std::size_t>(i)]);
      }
    } else if constexpr (role == detail::role::shared) {
      to = from;
    }  // layout: stays {} (value-initialised)
  });
  return out;
}

/// The batch with only columns [begin, end) of each ragged column group (`keep[g]` for the g-th
/// group of `ragged_columns`); every other member copied. The widths a caller already knows on
/// the host (the token sampler's lengths) trim a batch without reading the device.
template <class B>
B keep_columns(const B& b,
               const std::array<std::pair<std::int64_t, std::int64_t>,
                                detail::group_table<typename detail::ragged_of<B>::type>::count>& keep) {
  static_assert(detail::check<B>());
  using table = detail::group_table<typename detail::ragged_of<B>::type>;
  B out = b;
  boost::hana::for_each(boost::hana::accessors<B>(), [&](auto pair) {
    using P = detail::pair_t<decltype(pair)>;
    if constexpr (std::is_same_v<detail::member_t<B, P>, torch::Tensor>) {
      constexpr int g = table::group_of(detail::member_name<P>());
      if constexpr (g >= 0) {
        auto& t = boost::hana::second(pair)(out);
        const std::int64_t lo = keep[static_cast<std::size_t>(g)].first, hi = keep[static_cast<std::size_t>(g)].second;
        UNIRL_CHECK(!t.defined() || (t.dim() >= 2 && 0 <= lo && lo <= hi && hi <= t.size(1)),
                    "batch::keep_columns: columns [", lo, ", ", hi, ") of member '", detail::member_name<P>(),
                    "' with sizes ", t.defined() ? t.sizes() : torch::IntArrayRef{},
                    "; expected a range within dimension 1");
        if (t.defined()) t = t.slice(1, lo, hi);
      }
    }
  });
  return out;
}

/// Dynamic padding: the same samples without the columns that are padding in every row, per
/// ragged column group (`ragged_columns`); every other member copied. A batch without ragged
/// columns comes back as it is. The masks of all groups are read in one host read.
template <class B>
B trim(const B& b) {
  static_assert(detail::check<B>());
  using table = detail::group_table<typename detail::ragged_of<B>::type>;
  std::array<std::pair<std::int64_t, std::int64_t>, table::count> keep{};
  if constexpr (table::count > 0) {
    std::array<torch::Tensor, table::count> used{};
    for (std::size_t g = 0; g < table::count; ++g) {
      boost::hana::for_each(boost::hana::accessors<B>(), [&](auto pair) {
        using P = detail::pair_t<decltype(pair)>;
        if constexpr (std::is_same_v<detail::member_t<B, P>, torch::Tensor>)
          if (detail::member_name<P>() == table::masks[g])
            used[g] = detail::used_columns(boost::hana::second(pair)(b), table::masks[g]);
      });
    }
    std::vector<torch::Tensor> parts;
    for (const auto& u : used) parts.push_back(u.to(used.front().device()));
    const auto read = to_host(torch::cat(parts));  // one read for every group
    std::size_t at = 0;
    for (std::size_t g = 0; g < table::count; ++g) {
      const auto W = used[g].size(0);
      keep[g] = detail::kept_columns(read.data() + at, W, table::sides[g]);
      at += static_cast<std::size_t>(W);
    }
  }
  return keep_columns(b, keep);
}

/// Zero padding for `concat`: every ragged member is padded with 0.
struct zero_fill {
  double operator()(std::string_view) const { return 0.0; }
};

/// The parts one after the other: per-sample tensors concatenated on dimension 0 (ragged
/// column groups first padded to the widest part, on the group's side, with `fill(member)`),
/// per-sample vectors appended, shared members checked equal and kept once, layout members
/// reset. Parts must agree on which members are defined / non-empty.
template <class B, class Fill = zero_fill>
B concat(const std::vector<B>& parts, Fill fill = {}) {
  static_assert(detail::check<B>());
  using table = detail::group_table<typename detail::ragged_of<B>::type>;
  if (parts.empty()) return B{};
  std::array<std::int64_t, table::count> width{};
  for (std::size_t g = 0; g < table::count; ++g) {
    boost::hana::for_each(boost::hana::accessors<B>(), [&](auto pair) {
      using P = detail::pair_t<decltype(pair)>;
      if constexpr (std::is_same_v<detail::member_t<B, P>, torch::Tensor>)
        if (detail::member_name<P>() == table::masks[g])
          for (const auto& p : parts) {
            const auto& m = boost::hana::second(pair)(p);
            if (m.defined()) width[g] = std::max(width[g], m.size(1));
          }
    });
  }
  B out{};
  boost::hana::for_each(boost::hana::accessors<B>(), [&](auto pair) {
    using P = detail::pair_t<decltype(pair)>;
    constexpr auto role = detail::role_of<B, P>();
    [[maybe_unused]] constexpr auto n = detail::member_name<P>();
    auto& to = boost::hana::second(pair)(out);
    if constexpr (role == detail::role::per_sample_tensor) {
      const bool first_defined = boost::hana::second(pair)(parts.front()).defined();
      std::vector<torch::Tensor> xs;
      xs.reserve(parts.size());
      for (const auto& p : parts) {
        const torch::Tensor& x = boost::hana::second(pair)(p);
        UNIRL_CHECK(x.defined() == first_defined, "concat: member '", n, "' is defined in some parts only");
        if (!first_defined) continue;
        constexpr int g = table::group_of(n);
        if constexpr (g >= 0) {
          const auto pad = width[static_cast<std::size_t>(g)] - x.size(1);
          if (pad > 0) {
            const std::vector<std::int64_t> before_after =
                table::sides[static_cast<std::size_t>(g)] == pad_side::left ? std::vector<std::int64_t>{pad, 0} : std::vector<std::int64_t>{0, pad};
            // constant_pad_nd pads the last dimensions first: move the column axis last and back.
            const auto moved = x.dim() > 2 ? x.movedim(1, -1) : x;
            const auto padded = torch::constant_pad_nd(moved, before_after, fill(n));
            xs.push_back(x.dim() > 2 ? padded.movedim(-1, 1) : padded);
            continue;
          }
        }
        xs.push_back(x);
      }
      if (first_defined) to = torch::cat(xs, 0);
    } else if constexpr (role == detail::role::per_sample_vector) {
      const bool first_empty = boost::hana::second(pair)(parts.front()).empty();
      for (const auto& p : parts) {
        const auto& v = boost::hana::second(pair)(p);
        UNIRL_CHECK(v.empty() == first_empty, "concat: member '", n, "' is empty in some parts only");
        to.insert(to.end(), v.begin(), v.end());
      }
    } else if constexpr (role == detail::role::shared) {
      const auto& first = boost::hana::second(pair)(parts.front());
      for (const auto& p : parts) {
        const auto& v = boost::hana::second(pair)(p);
        if constexpr (std::is_same_v<detail::member_t<B, P>, torch::Tensor>)
          UNIRL_CHECK(v.defined() == first.defined() && (!v.defined() || (v.sizes() == first.sizes() &&
                                                                          v.scalar_type() == first.scalar_type() &&
                                                                          torch::equal(v.to(first.device()), first))),
                      "concat: shared member '", n, "' differs between parts");
        else
          UNIRL_CHECK(v == first, "concat: shared member '", n, "' differs between parts");
      }
      to = first;
    }  // layout: stays {}
  });
  return out;
}

/// The batch with every defined tensor member on `device` (per-sample, shared and layout alike).
template <class B>
B to(const B& b, torch::Device device, bool non_blocking = false) {
  static_assert(detail::check<B>());
  B out = b;
  boost::hana::for_each(boost::hana::accessors<B>(), [&](auto pair) {
    using P = detail::pair_t<decltype(pair)>;
    if constexpr (std::is_same_v<detail::member_t<B, P>, torch::Tensor>) {
      auto& t = boost::hana::second(pair)(out);
      if (t.defined()) t = t.to(device, non_blocking);
    }
  });
  return out;
}

}  // namespace unirl::batch
