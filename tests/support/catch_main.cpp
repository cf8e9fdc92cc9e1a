// The Catch2 main shared by loom's tests. It prints the seed of the seeded generators so a failing
// run can be replayed with LOOM_TEST_SEED=<seed>. The kokkos flavour brackets the session with
// Kokkos::initialize / finalize, the mpi flavour with MPI_Init_thread / MPI_Finalize (the exit
// status is the worst over ranks, so mpiexec reports any rank's failure).
#define CATCH_CONFIG_RUNNER
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
