#pragma once
// upward: core sits below concepts
#include <unirl/concepts/model.hpp>
