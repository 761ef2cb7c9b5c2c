// Compiled with the examples' precompiled header so CMake builds it once for all of them.
