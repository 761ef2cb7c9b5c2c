// Compiled with the precompiled header so CMake builds it once for every test executable
// (catch_main.cpp skips it: Catch2 needs CATCH_CONFIG_MAIN before catch.hpp).
