#pragma once

// Symbols of the public C++ API are exported from libfusedmha; everything
// else is hidden (the library is built with -fvisibility=hidden).
#if defined(_WIN32)
#if defined(FUSEDMHA_BUILDING_LIBRARY)
#define FUSEDMHA_API __declspec(dllexport)
#else
#define FUSEDMHA_API __declspec(dllimport)
#endif
#else
#define FUSEDMHA_API __attribute__((visibility("default")))
#endif
