// The Catch2 main shared by loom's tests. It prints the seed of the seeded generators so a failing
// run can be replayed with LOOM_TEST_SEED=<seed>. The kokkos flavour brackets the session with
// Kokkos::initialize / finalize, the mpi flavour with MPI_Init_thread / MPI_Finalize (the exit
// status is the worst over ranks, so mpiexec reports any rank's failure).
#define CATCH_CONFIG_RUNNER
#include <support/allocations.hpp>
#include <support/random.hpp>

#include <catch2/catch.hpp>

#if defined(LOOM_TEST_MAIN_KOKKOS)
#include <Kokkos_Core.hpp>
#endif
#if defined(LOOM_TEST_MAIN_MPI)
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <new>

// Every operator new of a test executable (all forms, nothrow and aligned included, so that every
// new and delete pair goes through the same malloc / free) is counted per thread
// (support/allocations.hpp).
namespace {
thread_local long long heap_allocations = 0;
thread_local int count_paused = 0;
void* counted_alloc(std::size_t n, std::size_t align) {
  if (count_paused == 0) ++heap_allocations;
  if (n == 0) n = 1;
  void* p =
      align <= alignof(std::max_align_t) ? std::malloc(n) : std::aligned_alloc(align, (n + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

long long loom::test::allocations_on_this_thread() noexcept { return heap_allocations; }
void loom::test::pause_allocation_count(int delta) noexcept { count_paused += delta; }

void* operator new(std::size_t n) { return counted_alloc(n, alignof(std::max_align_t)); }
void* operator new[](std::size_t n) { return counted_alloc(n, alignof(std::max_align_t)); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_alloc(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_alloc(n, static_cast<std::size_t>(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, alignof(std::max_align_t));
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return counted_alloc(n, static_cast<std::size_t>(a));
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept {
  return operator new(n, a, t);
}
// These deletes pair with the news above (both malloc / free); GCC, seeing free() inlined where a
// library new-expression allocated, cannot know the new was replaced too.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

int main(int argc, char** argv) {
#if defined(LOOM_TEST_MAIN_KOKKOS)
  Kokkos::ScopeGuard kokkos(argc, argv);
#endif
#if defined(LOOM_TEST_MAIN_MPI)
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0)
#endif
    std::fprintf(stderr, "loom tests: LOOM_TEST_SEED=%llu\n", static_cast<unsigned long long>(loom::test::seed()));
  int status = Catch::Session().run(argc, argv);
#if defined(LOOM_TEST_MAIN_MPI)
  int worst = 0;
  MPI_Allreduce(&status, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  status = worst;
#endif
  return status;
}
