#pragma once
// a folder of the same layer
#include <unirl/data/jsonl.hpp>
