// The Catch2 main shared by loom's tests. It prints the seed of the seeded generators so a failing
// run can be replayed with LOOM_TEST_SEED=<seed>; the kokkos flavour brackets the session with
// Kokkos::initialize / finalize.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <support/random.hpp>

#if defined(LOOM_TEST_MAIN_KOKKOS)
#include <Kokkos_Core.hpp>
#endif

#include <cstdio>

int main(int argc, char** argv) {
#if defined(LOOM_TEST_MAIN_KOKKOS)
  Kokkos::ScopeGuard kokkos(argc, argv);
#endif
  std::fprintf(stderr, "loom tests: LOOM_TEST_SEED=%llu\n", static_cast<unsigned long long>(loom::test::seed()));
  return Catch::Session().run(argc, argv);
}
