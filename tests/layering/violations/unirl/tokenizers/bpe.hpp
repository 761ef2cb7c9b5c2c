#pragma once
#include <unirl/data/jsonl.hpp>
