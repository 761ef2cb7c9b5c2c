#pragma once
/// \file single_device.hpp
/// One process, one device: every collective is the identity (`parallel::single_device`, defined
/// with the `ParallelStrategy` concept so that `train::update_engine` can default to it).
#include <unirl/concepts/parallel.hpp>

namespace unirl {
/// The former name of `unirl::parallel`, kept so that existing code compiles.
namespace par = parallel;
}  // namespace unirl
