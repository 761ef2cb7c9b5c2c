#pragma once
// a concrete model reached through a subfolder
#include <unirl/models/hf/causal_lm.hpp>
