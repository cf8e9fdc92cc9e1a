#pragma once

//! @file
//! Compiler and platform configuration shared by every loom header.

#include <loom/version.hpp>

#if defined(__CUDACC__) || defined(__HIPCC__)
//! Marks a function callable from host and device code; one body serves every backend.
#define LOOM_HD __host__ __device__
#define LOOM_DEVICE_COMPILER 1
#else
#define LOOM_HD
#define LOOM_DEVICE_COMPILER 0
#endif

#if defined(__CUDA_ARCH__)
#define LOOM_IN_DEVICE_CODE 1
#else
#define LOOM_IN_DEVICE_CODE 0
#endif

#if defined(_OPENMP)
#define LOOM_HAS_OPENMP 1
#else
#define LOOM_HAS_OPENMP 0
#endif

#define LOOM_STRINGIFY_IMPL(x) #x
#define LOOM_STRINGIFY(x) LOOM_STRINGIFY_IMPL(x)
