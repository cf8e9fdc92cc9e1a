#pragma once

//! @file
//! loom::kokkos<ExecSpace>: any Kokkos execution space. Link loom::kokkos. The caller owns
//! Kokkos::initialize / finalize.

#include <loom/backend/detail/parallel_kokkos.hpp>
#include <loom/backend/traits.hpp>

#include <Kokkos_Core.hpp>

#include <type_traits>

namespace loom {

//! Runs on the Kokkos execution space instance `space`.
template <class ExecSpace = Kokkos::DefaultHostExecutionSpace>
struct kokkos {
  using execution_space = ExecSpace;
  ExecSpace space{};
};

template <class ExecSpace>
struct backend_traits<kokkos<ExecSpace>> {
  using memory_space =
      std::conditional_t<Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible,
                         host_memory, cuda_memory>;
  static constexpr std::string_view name() noexcept { return "kokkos"; }
  static void fence(const kokkos<ExecSpace>& b) { b.space.fence(); }
  static int concurrency(const kokkos<ExecSpace>& b) { return static_cast<int>(b.space.concurrency()); }
};

}  // namespace loom
