#pragma once
#include "unirl/models/gpt.hpp"
