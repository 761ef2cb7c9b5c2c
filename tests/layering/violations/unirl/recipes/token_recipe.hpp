#pragma once
// recipes sit on top: everything below may be included (no violation)
#include <unirl/trainer.hpp>
#include <unirl/io/safetensors.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/train/sft.hpp>
