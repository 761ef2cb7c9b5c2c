#pragma once
#include <unirl/core/context.hpp>
