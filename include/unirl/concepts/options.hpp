#pragma once
/// \file options.hpp
/// Options aggregates: what the generic options routines (core/options.hpp: print, recipe
/// loading, overrides, validation) and the `Algorithm` concept need from an `options` type.
///
/// ```cpp
/// struct my_options { double lr = 1e-3; int steps = 100; };
/// BOOST_HANA_ADAPT_STRUCT(my_options, lr, steps);
/// static_assert(unirl::Reflectable<my_options>);
/// ```
/// Also reachable as `unirl::options::Reflectable` (its former home).
#include <boost/hana.hpp>

namespace unirl {

/// A type adapted with Boost.Hana, usable by the options routines.
///
/// Minimal complete definition: `BOOST_HANA_ADAPT_STRUCT(T, members...)` (or a
/// `boost::hana::accessors_impl` specialisation) whose members are bool, integers, floating
/// point, `std::string`, enums with `unirl::enum_names`, `std::vector` of those, or reflectable
/// types themselves. Optionally `void validate(const std::string& prefix) const`, which throws
/// `unirl::config_error` naming `prefix + "member"` for an out-of-range value.
template <class T>
concept Reflectable = boost::hana::Struct<T>::value;

namespace options {
using unirl::Reflectable;
}  // namespace options

}  // namespace unirl
