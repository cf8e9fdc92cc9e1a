// comm::mpi under mpiexec: the conformance suite on MPI_COMM_WORLD and through comm::any, and the
// error paths (receive size mismatch, ranks that disagree on a collective or on all_to_allv counts,
// one rank's bad arguments, timeouts). Each process checks its own rank's report.
//
// Timeout tests run on a duplicate of MPI_COMM_WORLD with a short timeout, and end cleanly: the
// late rank joins afterwards (its call completes the operations the others abandoned), so no
// request is left pending at MPI_Finalize. The hidden case [.abort] ends the job with MPI_Abort;
// its own ctest entry checks the output.

#include <loom/comm/any.hpp>
#include <loom/comm/mpi.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <comm/conformance.hpp>
#include <string>
#include <vector>

using loom::comm::mpi;
using loom::comm::mpi_options;
using loom::test::rank_report;
using ms = std::chrono::milliseconds;

static_assert(loom::comm::communicator<loom::comm::mpi>);

namespace {
void check_report(const rank_report& r, int rank) {
  INFO("rank " << rank);
  for (const auto& f : r.failures) FAIL_CHECK(f);
  CHECK(r.failures.empty());
  CHECK(r.checks > 0);
}

// A duplicate of MPI_COMM_WORLD, freed at scope exit, so a timeout leaves WORLD usable.
struct world_dup {
  MPI_Comm raw = MPI_COMM_NULL;
  world_dup() { MPI_Comm_dup(MPI_COMM_WORLD, &raw); }
  ~world_dup() { MPI_Comm_free(&raw); }
  world_dup(const world_dup&) = delete;
  world_dup& operator=(const world_dup&) = delete;
};

// What a call threw: "code|what", or "" when it returned.
template <class F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const loom::error& e) {
    return std::string(loom::to_string(e.code())) + "|" + e.what();
  }
  return "";
}

using clk = std::chrono::steady_clock;
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
  // And a message longer than the receive: MPI's truncation error, on the receiver; the sender
  // completes (or would time out), it never hangs.
  std::vector<int> more(c.rank() == 0 ? 5 : 3, 2);
  if (c.rank() == 0) {
    auto q = c.isend(std::span<const int>(more), 1, 13);
    c.wait(q);
  } else if (c.rank() == 1) {
    auto q = c.irecv(std::span<int>(more), 0, 13);
    CHECK_THROWS_WITH(c.wait(q), Catch::Contains("wait on rank 1 for irecv(src=0, tag=13, 3 x i32)") &&
                                     Catch::Contains("MPI_Irecv failed"));
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

TEST_CASE("comm::mpi one rank's bad arguments throw on every rank", "[comm][mpi][errors]") {
  mpi c;
  // Rank 1's recv is one element short: it throws shape_mismatch, the others name it.
  std::vector<int> s(3, c.rank()), r(3 * static_cast<std::size_t>(c.size()) - (c.rank() == 1 ? 1 : 0));
  const std::string e = thrown([&] { c.all_gather(std::span<const int>(s), std::span<int>(r)); });
  INFO("rank " << c.rank() << ": " << e);
  if (c.rank() == 1)
    CHECK_THAT(e, Catch::StartsWith("shape_mismatch|") && Catch::Contains("all_gather on rank 1: recv holds"));
  else
    CHECK_THAT(e, Catch::StartsWith("shape_mismatch|") && Catch::Contains("rank 1 rejected its arguments"));
  // A root out of range on one rank.
  int v = 0;
  const std::string b = thrown([&] { c.broadcast(std::span<int>(&v, 1), c.rank() == 0 ? c.size() : 0); });
  CHECK_THAT(b, Catch::StartsWith("invalid_argument|") && Catch::Contains("broadcast"));
  if (c.rank() == 0) CHECK_THAT(b, Catch::Contains("root must be in [0, "));
  // An all_to_allv block outside its buffer on the last rank.
  const auto p = static_cast<std::size_t>(c.size());
  const bool last = c.rank() == c.size() - 1;
  std::vector<std::size_t> sc(p, 1), sd(p), rc(p, 1), rd(p);
  for (std::size_t q = 0; q < p; ++q) sd[q] = rd[q] = q;
  if (last) sd[0] = p;
  std::vector<int> vs(p), vr(p);
  const std::string av = thrown([&] {
    c.all_to_allv(std::span<const int>(vs), std::span<const std::size_t>(sc), std::span<const std::size_t>(sd),
                  std::span<int>(vr), std::span<const std::size_t>(rc), std::span<const std::size_t>(rd));
  });
  CHECK_THAT(av, Catch::StartsWith("shape_mismatch|") && Catch::Contains("all_to_allv"));
  CHECK_THAT(av, Catch::Contains(last ? "send block for rank 0 [" : " rejected its arguments"));
  // split agrees even without check_collectives: a negative color on one rank throws everywhere.
  mpi unchecked(MPI_COMM_WORLD, {.check_collectives = false});
  const std::string sp = thrown([&] { (void)unchecked.split(c.rank() == 0 ? -1 : 0, 0); });
  CHECK_THAT(sp, Catch::StartsWith("invalid_argument|") && Catch::Contains("split"));
  if (c.rank() == 0) CHECK_THAT(sp, Catch::Contains("color must be >= 0, got -1"));
  c.barrier();  // still usable afterwards
}

TEST_CASE("comm::mpi all_to_allv whose counts disagree throws on every rank", "[comm][mpi][errors]") {
  mpi c;
  const auto p = static_cast<std::size_t>(c.size());
  // Everyone sends one element to everyone; rank 0 expects `expect` from rank 1 instead.
  for (std::size_t expect : {std::size_t{2}, std::size_t{0}}) {
    INFO("rank 0 expects " << expect << " from rank 1, on rank " << c.rank());
    std::vector<std::size_t> sc(p, 1), sd(p), rc(p, 1), rd(p);
    if (c.rank() == 0) rc[1] = expect;
    std::size_t at = 0;
    for (std::size_t q = 0; q < p; ++q) sd[q] = q, rd[q] = at, at += rc[q];
    std::vector<int> send(p, c.rank()), recv(at + 1, -7);
    const std::string e = thrown([&] {
      c.all_to_allv(std::span<const int>(send), std::span<const std::size_t>(sc), std::span<const std::size_t>(sd),
                    std::span<int>(recv), std::span<const std::size_t>(rc), std::span<const std::size_t>(rd));
    });
    CHECK_THAT(e, Catch::StartsWith("comm_failure|") && Catch::Contains("all_to_allv") &&
                      Catch::Contains("rank 1 sends 1 elements to rank 0, which expects " + std::to_string(expect)));
    for (int x : recv) CHECK(x == -7);  // nothing moved
  }
  c.barrier();
}

TEST_CASE("comm::mpi rejects bad options and peers", "[comm][mpi][errors]") {
  CHECK_THROWS_WITH(mpi(MPI_COMM_WORLD, {.timeout = ms(0)}), Catch::Contains("options.timeout must be > 0 ms, got 0"));
  mpi c;
  float x = 0;
  CHECK_THROWS_WITH(c.isend(std::span<const float>(&x, 1), c.size(), 0), Catch::Contains("dest must be in [0, "));
  CHECK_THROWS_WITH(c.irecv(std::span<float>(&x, 1), -1, 0), Catch::Contains("src must be in [0, "));
  CHECK_THROWS_WITH(c.isend(std::span<const float>(&x, 1), 0, -3), Catch::Contains("tag must be >= 0, got -3"));
  CHECK(c.usable());
  CHECK(c.options().check_collectives);
}

TEST_CASE("comm::mpi waiting a request again, or a copy of it, is a no-op", "[comm][mpi]") {
  mpi c;
  const int p = c.size(), me = c.rank();
  int out = me, in = -1;
  auto r = c.irecv(std::span<int>(&in, 1), (me + p - 1) % p, 12);
  auto s = c.isend(std::span<const int>(&out, 1), (me + 1) % p, 12);
  auto r2 = r, s2 = s;
  c.wait(s);
  c.wait(r);
  CHECK(!r2.valid());
  CHECK(!s2.valid());
  c.wait(s2);
  c.wait(r2);
  c.wait(r);
  CHECK(in == (me + p - 1) % p);
  c.barrier();
}

TEST_CASE("comm::mpi a rank that skips a collective: the others time out naming the call",
          "[comm][mpi][errors][timeout]") {
  mpi world;
  const int skipper = world.size() - 1;
  const bool skips = world.rank() == skipper;
  for (const bool checked : {true, false}) {
    INFO("check_collectives = " << checked << ", rank " << world.rank());
    world_dup dup;
    // The late rank's own wrapper waits long: its late call must meet the abandoned ones.
    mpi c(dup.raw, {.check_collectives = checked, .timeout = skips ? ms(30000) : ms(300)});
    std::vector<double> x(5, 1.0);  // alive until the late rank has joined: MPI may still write it
    if (!skips) {
      const auto start = clk::now();
      const std::string e =
          thrown([&] { c.all_reduce(std::span<const double>(x), std::span<double>(x), loom::comm::reduce_op::sum); });
      CHECK(clk::now() - start < std::chrono::seconds(5));
      CHECK_THAT(e, Catch::StartsWith("timeout|") && Catch::Contains("comm::mpi all_reduce on rank") &&
                        Catch::Contains("did not complete within 300 ms") && Catch::Contains("unusable"));
      CHECK_THAT(e, Catch::Contains(checked ? "MPI_Iallreduce (signature check)" : "MPI_Iallreduce did not"));
      CHECK(!c.usable());
      CHECK_THAT(thrown([&] { c.barrier(); }),
                 Catch::StartsWith("comm_failure|") && Catch::Contains("unusable after an earlier timeout"));
      float f = 0;
      CHECK_THAT(thrown([&] { (void)c.isend(std::span<const float>(&f, 1), 0, 0); }), Catch::Contains("unusable"));
    }
    world.barrier();  // the others have timed out
    if (skips) {
      // Late. With the check, the others abandoned the signature check of their all_reduce: a
      // barrier meets it (and finds that the calls differ). Without it, they abandoned the
      // all_reduce itself: the same all_reduce completes it.
      const std::string e = checked ? thrown([&] { c.barrier(); }) : thrown([&] {
        c.all_reduce(std::span<const double>(x), std::span<double>(x), loom::comm::reduce_op::sum);
      });
      if (checked)
        CHECK_THAT(e, Catch::StartsWith("comm_failure|") && Catch::Contains("barrier") &&
                          Catch::Contains("disagree on the call"));
      else
        CHECK(e.empty());
      CHECK(c.usable());
    }
    world.barrier();  // the others' abandoned requests have completed (progressed in this barrier)
  }
}

TEST_CASE("comm::mpi point-to-point waits time out naming the wait", "[comm][mpi][errors][timeout]") {
  mpi world;
  world_dup dup;
  mpi c(dup.raw, {.timeout = world.rank() == 0 ? ms(300) : ms(30000)});
  SECTION("an irecv whose sender never sends is cancelled") {
    if (world.rank() == 0) {
      int x = 0;
      auto q = c.irecv(std::span<int>(&x, 1), 1, 21);
      auto later = c.irecv(std::span<int>(&x, 1), 1, 22);
      CHECK_THAT(thrown([&] { c.wait(q); }), Catch::StartsWith("timeout|") &&
                                                 Catch::Contains("wait on rank 0 for irecv(src=1, tag=21, 1 x i32)") &&
                                                 Catch::Contains("timed out after 300 ms waiting for rank 1"));
      CHECK(!c.usable());
      CHECK_THAT(thrown([&] { c.wait(later); }), Catch::Contains("unusable"));  // and cancelled
      CHECK(!later.valid());
    }
    world.barrier();
  }
  SECTION("an isend whose receiver comes late is freed; the late receive still completes") {
    // 4 MiB: beyond any eager limit, so the send cannot complete before the receive is posted.
    std::vector<float> big(std::size_t{1} << 20, 2.5f);  // alive until the late receive is done
    if (world.rank() == 0) {
      auto q = c.isend(std::span<const float>(big), 1, 23);
      CHECK_THAT(thrown([&] { c.wait(q); }), Catch::StartsWith("timeout|") &&
                                                 Catch::Contains("isend(dest=1, tag=23, 1048576 x f32)") &&
                                                 Catch::Contains("waiting for rank 1"));
      CHECK(!q.valid());
    }
    world.barrier();  // rank 0 has given up
    if (world.rank() == 1) {
      std::vector<float> in(big.size(), 0.f);
      auto q = c.irecv(std::span<float>(in), 0, 23);
      CHECK(thrown([&] { c.wait(q); }).empty());
      CHECK(in == big);
    }
    world.barrier();  // rank 0 progresses its freed send here
  }
  SECTION("a sendrecv whose peer is absent: the send times out and the receive is cancelled") {
    std::vector<float> big(std::size_t{1} << 20, 1.5f), in(big.size(), 0.f);
    if (world.rank() == 0) {
      CHECK_THAT(thrown([&] { c.sendrecv(std::span<const float>(big), 1, std::span<float>(in), 1, 24); }),
                 Catch::StartsWith("timeout|") && Catch::Contains("isend(dest=1, tag=24"));
      CHECK(!c.usable());
    }
    world.barrier();
    if (world.rank() == 1) {  // late: takes the abandoned send, sends nothing (the receive is gone)
      auto q = c.irecv(std::span<float>(in), 0, 24);
      CHECK(thrown([&] { c.wait(q); }).empty());
      CHECK(in == big);
    }
    world.barrier();
  }
}

// Run alone, by its own ctest entry: the job ends in MPI_Abort.
TEST_CASE("comm::mpi abort_on_timeout ends the job", "[.abort]") {
  mpi world;
  world_dup dup;
  mpi c(dup.raw, {.timeout = ms(300), .abort_on_timeout = true});
  if (world.rank() != world.size() - 1) c.barrier();  // the last rank skips it: rank 0 aborts the job
}
