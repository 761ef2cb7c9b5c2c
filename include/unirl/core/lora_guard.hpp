#pragma once
/// \file lora_guard.hpp
/// The switch of LoRA adapters (models/lora.hpp), here so that every layer may use it: while a
/// `lora::disabled_guard` lives, forwards on its thread run without adapters. The algorithms
/// score the reference model inside one: a policy with adapters is its own reference, the base
/// model with the adapters off, so no second copy of the weights is kept.
///
/// ```cpp
/// {
///   const unirl::lora::disabled_guard base;   // this thread: adapters off
///   ref_logits = reference.logits(ids, mask);
/// }
/// auto v = unirl::lora::without_adapters([&] { return reference.velocity(x, t, c); });
/// ```
#include <utility>

namespace unirl::lora {

namespace detail {
inline int& disabled_depth() {
  thread_local int depth = 0;
  return depth;
}
}  // namespace detail

/// While one lives, forwards on this thread run without adapters (the base model). Nests.
class disabled_guard {
 public:
  disabled_guard() { ++detail::disabled_depth(); }
  ~disabled_guard() { --detail::disabled_depth(); }
  disabled_guard(const disabled_guard&) = delete;
  disabled_guard& operator=(const disabled_guard&) = delete;
};

/// Whether adapters are applied on this thread now (no `disabled_guard` alive).
inline bool enabled() { return detail::disabled_depth() == 0; }

/// `f()` with the adapters switched off: `lora::without_adapters([&] { return ref.logits(ids, mask); })`.
template <class F>
decltype(auto) without_adapters(F&& f) {
  const disabled_guard g;
  return std::forward<F>(f)();
}

}  // namespace unirl::lora
