#pragma once
// a concrete model in a sampler (and upward)
#include <unirl/models/gpt.hpp>
