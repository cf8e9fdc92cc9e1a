#pragma once

//! @file
//! loom's version. The single source of truth: CMake reads these lines.

#define LOOM_VERSION_MAJOR 0
#define LOOM_VERSION_MINOR 1
#define LOOM_VERSION_PATCH 0

#define LOOM_VERSION (LOOM_VERSION_MAJOR * 10000 + LOOM_VERSION_MINOR * 100 + LOOM_VERSION_PATCH)

namespace loom {
//! The library version as {major, minor, patch}.
struct version_info {
  int major, minor, patch;
};
inline constexpr version_info version{LOOM_VERSION_MAJOR, LOOM_VERSION_MINOR, LOOM_VERSION_PATCH};
}  // namespace loom
