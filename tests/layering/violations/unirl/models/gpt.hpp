#pragma once
#include <unirl/rollout/token_sampler.hpp>
/// #include <unirl/algorithms/ppo_env.hpp>  (a comment: not an include)
