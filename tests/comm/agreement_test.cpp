// Cross-rank agreement of every distributed primitive (tests/comm/agreement_cases.hpp): one rank
// given a different plan or a bad argument, the same loom::error on every rank. Built twice: over
// comm::local for P = 2..4 (LOOM_TEST_AGREEMENT_MPI undefined) and over comm::mpi, run under
// mpiexec -n 3 with a short timeout so that a hang would fail instead of waiting.

#include <catch2/catch.hpp>

#include "agreement_cases.hpp"

#if defined(LOOM_TEST_AGREEMENT_MPI)
#include <loom/comm/mpi.hpp>
#else
#include <loom/comm/local.hpp>

#include <mutex>
#endif

namespace lta = loom::test::agreement;

namespace {
void check(const lta::expectation& e, int rank) {
  INFO("rank " << rank << ", case: " << e.name << "\n  threw: " << e.message);
  CHECK(!e.message.empty());
  CHECK(e.got == e.code);
  CHECK_THAT(e.message, Catch::Contains(e.text));
  CHECK(e.same);
}
}  // namespace

#if defined(LOOM_TEST_AGREEMENT_MPI)
TEST_CASE("agreement over comm::mpi: one rank's bad argument or plan is every rank's error", "[comm][mpi][agreement]") {
  loom::comm::mpi comm(MPI_COMM_WORLD, {.timeout = std::chrono::milliseconds(20000)});
  REQUIRE(comm.size() >= 2);
  for (const auto& e : lta::run_all(comm)) check(e, comm.rank());
}
#else
TEST_CASE("agreement over comm::local: one rank's bad argument or plan is every rank's error, P = 2..4",
          "[comm][local][agreement]") {
  for (int p : {2, 3, 4}) {
    std::vector<std::vector<lta::expectation> > seen(static_cast<std::size_t>(p));
    loom::comm::run_local(
        p, [&](loom::comm::local& comm) { seen[static_cast<std::size_t>(comm.rank())] = lta::run_all(comm); });
    INFO("P = " << p);
    for (int r = 0; r < p; ++r) {
      REQUIRE(seen[static_cast<std::size_t>(r)].size() == seen[0].size());
      for (const auto& e : seen[static_cast<std::size_t>(r)]) check(e, r);
    }
  }
}
#endif
