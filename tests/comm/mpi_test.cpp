// comm::mpi under mpiexec: the conformance suite on MPI_COMM_WORLD and through comm::any, and the
// error paths MPI can report (receive size mismatch, ranks that disagree on a collective).
// Each process checks its own rank's report.

#include <loom/comm/any.hpp>
#include <loom/comm/mpi.hpp>

#include <catch2/catch.hpp>

#include <comm/conformance.hpp>

using loom::comm::mpi;
using loom::test::rank_report;

static_assert(loom::comm::communicator<loom::comm::mpi>);

namespace {
void check_report(const rank_report& r, int rank) {
  INFO("rank " << rank);
  for (const auto& f : r.failures) FAIL_CHECK(f);
  CHECK(r.failures.empty());
  CHECK(r.checks > 0);
}
}  // namespace

TEST_CASE("comm::mpi conforms", "[comm][mpi]") {
  mpi c;
  REQUIRE(c.size() >= 2);
  rank_report r;
  loom::test::conformance_suite(c, r);
  check_report(r, c.rank());
}

TEST_CASE("comm::any over comm::mpi conforms", "[comm][mpi][any]") {
  loom::comm::any c{mpi()};
  rank_report r;
  loom::test::conformance_suite(c, r, /*include_large=*/false);
  check_report(r, c.rank());
}

TEST_CASE("comm::mpi receive of the wrong size is an error, not a truncation", "[comm][mpi][errors]") {
  mpi c;
  // Rank 0 sends 3 elements to rank 1, which posted room for 5.
  std::vector<int> buf(c.rank() == 0 ? 3 : 5, 1);
  if (c.rank() == 0) {
    auto q = c.isend(std::span<const int>(buf), 1, 11);
    c.wait(q);
  } else if (c.rank() == 1) {
    auto q = c.irecv(std::span<int>(buf), 0, 11);
    CHECK_THROWS_WITH(c.wait(q), Catch::Contains("expects 5 elements") && Catch::Contains("held 3"));
  }
  c.barrier();
}

TEST_CASE("comm::mpi ranks that disagree on a collective all throw", "[comm][mpi][errors]") {
  mpi c;
  std::vector<double> x(c.rank() == 0 ? 4 : 5);
  CHECK_THROWS_WITH(c.all_reduce(std::span<const double>(x), std::span<double>(x), loom::comm::reduce_op::sum),
                    Catch::Contains("disagree on the element count"));
  int v = 0;
  if (c.rank() == 0) {
    CHECK_THROWS_WITH(c.barrier(), Catch::Contains("disagree on the call"));
  } else {
    CHECK_THROWS_WITH(c.broadcast(std::span<int>(&v, 1), 0), Catch::Contains("disagree on the call"));
  }
  c.barrier();  // still usable afterwards
}
