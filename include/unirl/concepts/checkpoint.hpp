#pragma once
/// \file checkpoint.hpp
/// States that travel in a checkpoint next to the model (vector environments with their
/// normalisation statistics, data loaders, anything a run needs to continue).
///
/// ```cpp
/// unirl::envs::vector_env<unirl::envs::pendulum> venv({}, {.normalize_observation = true});
/// static_assert(unirl::Checkpointable<decltype(venv)>);
/// t.save("run/ckpt.pt", venv);   // later: t.load("run/ckpt.pt", venv);
/// ```
#include <torch/torch.h>

namespace unirl {

/// A state that can travel in a checkpoint next to the model: the trainer's
/// `save(path, extras...)` / `load(path, extras...)` store each extra in the same file
/// (train/checkpoint.hpp holds the helpers that write tensors and scalars into an archive).
///
/// Minimal complete definition:
/// - `void save(torch::serialize::OutputArchive&) const` — writes everything needed to continue;
/// - `void load(torch::serialize::InputArchive&)` — restores it, throwing `checkpoint_error`
///   for an archive it cannot use.
template <class T>
concept Checkpointable = requires(const T& c, T& m, torch::serialize::OutputArchive& out,
                                  torch::serialize::InputArchive& in) {
  c.save(out);
  m.load(in);
};

}  // namespace unirl
