#pragma once

//! @file
//! Memory-space tags: where the bytes behind a pointer live, and who may dereference them.

#include <concepts>
#include <string_view>

namespace loom {

//! Ordinary host memory.
struct host_memory {
  static constexpr bool host_accessible = true;
  static constexpr std::string_view name() noexcept { return "host"; }
};

//! CUDA device memory (cudaMalloc); not dereferenceable on the host.
struct cuda_memory {
  static constexpr bool host_accessible = false;
  static constexpr std::string_view name() noexcept { return "cuda"; }
};

//! CUDA managed or pinned memory reachable from both sides.
struct cuda_managed_memory {
  static constexpr bool host_accessible = true;
  static constexpr std::string_view name() noexcept { return "cuda_managed"; }
};

//! A memory space tag: says whether the host may touch it and names itself.
template <class M>
concept memory_space = requires {
  { M::host_accessible } -> std::convertible_to<bool>;
  { M::name() } -> std::convertible_to<std::string_view>;
};

}  // namespace loom
