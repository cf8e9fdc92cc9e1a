#pragma once

//! @file
//! loom::openmp: host threads through OpenMP. Link loom::openmp (it adds the compiler flag).

#include <loom/backend/detail/parallel_openmp.hpp>
#include <loom/backend/traits.hpp>

#if LOOM_HAS_OPENMP
#include <omp.h>
#endif

namespace loom {

//! Host threads. threads = 0 uses OpenMP's default team size (OMP_NUM_THREADS).
struct openmp {
  int threads = 0;
};

template <>
struct backend_traits<openmp> {
  using memory_space = host_memory;
  static constexpr std::string_view name() noexcept { return "openmp"; }
  static void fence(const openmp&) noexcept {}
  static int concurrency(const openmp& b) noexcept {
#if LOOM_HAS_OPENMP
    return b.threads > 0 ? b.threads : omp_get_max_threads();
#else
    return b.threads > 0 ? b.threads : 1;
#endif
  }
};

}  // namespace loom
