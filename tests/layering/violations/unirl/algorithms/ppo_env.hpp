#pragma once
// a concrete environment in an algorithm
#include <unirl/envs/cartpole.hpp>
#include <unirl/concepts/model.hpp>
