#pragma once
// a subfolder belongs to its folder: models/hf is models
#include <unirl/algorithms/grpo.hpp>
#include <unirl/models/gpt.hpp>
