#pragma once

//! @file
//! backend_traits and the backend concept: what every execution policy must tell loom.

#include <loom/core/memory_space.hpp>

#include <concepts>
#include <string_view>

namespace loom {

//! Specialised by each backend policy: memory_space, name(), fence(b) and concurrency(b).
template <class B>
struct backend_traits;

//! An execution policy loom can run on: loom::serial, loom::openmp, loom::kokkos<S>, loom::cuda.
template <class B>
concept backend = requires(const B& b) {
  typename backend_traits<B>::memory_space;
  requires memory_space<typename backend_traits<B>::memory_space>;
  { backend_traits<B>::name() } -> std::convertible_to<std::string_view>;
  backend_traits<B>::fence(b);
  { backend_traits<B>::concurrency(b) } -> std::convertible_to<int>;
};

//! Blocks until all work submitted through `b` has finished.
template <backend B>
void fence(const B& b) {
  backend_traits<B>::fence(b);
}

namespace detail {
//! Per-backend implementation of the generic loops; specialised in backend/detail/.
template <class B>
struct parallel_impl;

template <class B>
inline constexpr bool always_false = false;
}  // namespace detail

}  // namespace loom
