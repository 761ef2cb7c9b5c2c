// Precompiled for every test executable: the heavy, stable headers only.
#pragma once
#include <torch/torch.h>
#include <catch2/catch.hpp>
#include <boost/hana.hpp>
#include <nlohmann/json.hpp>
