// Catch2 v2: defines main. Catch2 v3: main comes from Catch2::Catch2WithMain, <catch2/catch.hpp>
// is tests/support/catch2_v3_shim's and CATCH_CONFIG_MAIN means nothing, so this file is empty.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
