#pragma once
/// \file stb.hpp
/// Not API. Brings in stb_image_write (PNG output) and stb_easy_font (bitmap text) when unirl is
/// built with stb (`UNIRL_WITH_STB`). Every stb function is `static`, so each translation unit
/// gets its own private copy and any number of them can include this header in one program.
#if defined(UNIRL_WITH_STB)
#define UNIRL_HAS_STB 1
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#endif
#ifndef STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_STATIC
#endif
#ifndef STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define UNIRL_DETAIL_STB_UNDEF_WRITE_IMPL
#endif
#include <stb_image_write.h>
#include <stb_easy_font.h>
#if defined(UNIRL_DETAIL_STB_UNDEF_WRITE_IMPL)
#undef STB_IMAGE_WRITE_IMPLEMENTATION
#undef UNIRL_DETAIL_STB_UNDEF_WRITE_IMPL
#endif
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#else
#define UNIRL_HAS_STB 0
#endif
