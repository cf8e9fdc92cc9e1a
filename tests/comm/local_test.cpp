// comm::local: the conformance suite for P = 1..8, through comm::any too, and every error path.

#include <loom/backend/parallel.hpp>
#include <loom/comm/any.hpp>
#include <loom/comm/detail/poll.hpp>
#include <loom/comm/local.hpp>
#include <loom/comm/standin.hpp>

#include <support/tolerance.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <comm/conformance.hpp>
#include <comm/standin_device.hpp>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using loom::comm::local;
using loom::comm::run_local;
using loom::test::rank_report;

static_assert(loom::comm::communicator<loom::comm::local>);
static_assert(loom::comm::communicator<loom::comm::any>);

namespace {

// Every rank's report, checked on this thread.
void check_reports(const std::vector<rank_report>& reports, int p) {
  REQUIRE(reports.size() == static_cast<std::size_t>(p));
  for (int q = 0; q < p; ++q) {
    INFO("P = " << p << ", rank " << q);
    const auto& r = reports[static_cast<std::size_t>(q)];
    for (const auto& f : r.failures) FAIL_CHECK(f);
    CHECK(r.failures.empty());
    CHECK(r.checks > 0);
  }
}

// Runs `body(comm, report)` on P ranks and checks every rank's report on this thread.
template <class Body>
void on_ranks(int p, Body body) {
  auto reports = run_local(p, [&](local& c) {
    rank_report r;
    body(c, r);
    return r;
  });
  check_reports(reports, p);
}

using ms = std::chrono::milliseconds;

// Runs fn on P ranks and collects, per rank, the loom::error it threw (or nothing).
template <class Fn>
std::vector<std::string> errors_on_ranks(int p, Fn fn, ms timeout = ms(20000)) {
  return run_local(p,
                   [&](local& c) -> std::string {
                     try {
                       fn(c);
                     } catch (const loom::error& e) {
                       return std::string(loom::to_string(e.code())) + "|" + e.what();
                     }
                     return "";
                   },
                   {.timeout = timeout});
}

}  // namespace

#define LOOM_CONFORMANCE_CASE(name, fn)                                                \
  TEST_CASE("comm::local " name " conforms for P = 1..8", "[comm][local][" name "]") { \
    const int p = GENERATE(range(1, 9));                                               \
    on_ranks(p, [](local& c, rank_report& r) { loom::test::fn(c, r); });               \
  }

LOOM_CONFORMANCE_CASE("rank_size", conf_rank_size)
LOOM_CONFORMANCE_CASE("sendrecv", conf_sendrecv_ring)
LOOM_CONFORMANCE_CASE("zero_size", conf_zero_size)
LOOM_CONFORMANCE_CASE("many_outstanding", conf_many_outstanding)
LOOM_CONFORMANCE_CASE("all_gather", conf_all_gather)
LOOM_CONFORMANCE_CASE("all_to_all", conf_all_to_all)
LOOM_CONFORMANCE_CASE("all_to_allv", conf_all_to_allv)
LOOM_CONFORMANCE_CASE("all_reduce", conf_all_reduce)
LOOM_CONFORMANCE_CASE("reduce_scatter", conf_reduce_scatter)
LOOM_CONFORMANCE_CASE("broadcast", conf_broadcast)
LOOM_CONFORMANCE_CASE("barrier", conf_barrier)
LOOM_CONFORMANCE_CASE("split", conf_split)

TEST_CASE("comm::local moves 64 MiB messages", "[comm][local][large]") {
  const int p = GENERATE(1, 2, 3, 8);
  on_ranks(p, [](local& c, rank_report& r) { loom::test::conf_large(c, r); });
}

TEST_CASE("comm::any over comm::local conforms", "[comm][any]") {
  const int p = GENERATE(1, 3, 4);
  on_ranks(p, [](local& c, rank_report& r) {
    loom::comm::any a(c);
    loom::test::conformance_suite(a, r, /*include_large=*/false);
  });
}

TEST_CASE("comm::local barrier really separates phases", "[comm][local][barrier]") {
  const int p = GENERATE(2, 5, 8);
  std::atomic<int> before{0};
  auto seen = run_local(p, [&](local& c) {
    before.fetch_add(1);
    c.barrier();
    return before.load();
  });
  for (int v : seen) CHECK(v == p);
}

TEST_CASE("comm::local reductions are bitwise reproducible", "[comm][local][determinism]") {
  auto once = [] {
    return run_local(5, [](local& c) {
      std::vector<double> x(257);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = 1.0 / static_cast<double>(3 + i + 7 * c.rank());
      c.all_reduce(std::span<const double>(x), std::span<double>(x), loom::comm::reduce_op::sum);
      return x;
    });
  };
  const auto a = once(), b = once();
  for (std::size_t r = 0; r < a.size(); ++r) CHECK(a[r] == b[r]);  // exact: rank-ordered combination
  for (std::size_t r = 1; r < a.size(); ++r) CHECK(a[r] == a[0]);  // every rank holds the same bits
}

// ---------------------------------------------------------------------------------------------
// Error paths: each is a loom::error on every rank involved, never a hang.

TEST_CASE("comm::local collective with mismatched sizes fails on every rank", "[comm][local][errors]") {
  const auto errs = errors_on_ranks(3, [](local& c) {
    std::vector<double> x(c.rank() == 2 ? 4 : 5);
    c.all_reduce(std::span<const double>(x), std::span<double>(x), loom::comm::reduce_op::sum);
  });
  for (const auto& e : errs) {
    CHECK_THAT(e, Catch::Contains("comm_failure|") && Catch::Contains("all_reduce") && Catch::Contains("contributes"));
  }
}

TEST_CASE("comm::local collective with mismatched element types fails on every rank", "[comm][local][errors]") {
  const auto errs = errors_on_ranks(4, [](local& c) {
    if (c.rank() == 1) {
      std::vector<float> x(3), y(12);
      c.all_gather(std::span<const float>(x), std::span<float>(y));
    } else {
      std::vector<double> x(3), y(12);
      c.all_gather(std::span<const double>(x), std::span<double>(y));
    }
  });
  for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("all_gather") && Catch::Contains("f32"));
}

TEST_CASE("comm::local different collectives in the same slot fail on every rank", "[comm][local][errors]") {
  const auto errs = errors_on_ranks(3, [](local& c) {
    if (c.rank() == 0) {
      c.barrier();
    } else {
      int v = 0;
      c.broadcast(std::span<int>(&v, 1), 0);
    }
  });
  for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("mismatch") && Catch::Contains("barrier"));
}

TEST_CASE("comm::local rejects bad collective arguments on every rank", "[comm][local][errors]") {
  SECTION("all_gather recv of the wrong size") {
    const auto errs = errors_on_ranks(2, [](local& c) {
      std::vector<int> s(3), r(c.rank() == 0 ? 6 : 5);
      c.all_gather(std::span<const int>(s), std::span<int>(r));
    });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("recv holds 5 elements"));
  }
  SECTION("all_to_all not divisible by P") {
    const auto errs = errors_on_ranks(3, [](local& c) {
      std::vector<int> s(4), r(4);
      c.all_to_all(std::span<const int>(s), std::span<int>(r));
    });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("not a multiple"));
  }
  SECTION("all_to_allv counts that disagree between ranks") {
    const auto errs = errors_on_ranks(2, [](local& c) {
      std::vector<std::size_t> sc{1, 1}, sd{0, 1}, rc{1, c.rank() == 0 ? 2u : 1u}, rd{0, 1};
      std::vector<int> s(2), r(3);
      c.all_to_allv(std::span<const int>(s), std::span<const std::size_t>(sc), std::span<const std::size_t>(sd),
                    std::span<int>(r), std::span<const std::size_t>(rc), std::span<const std::size_t>(rd));
    });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("which expects 2"));
  }
  SECTION("all_to_allv block outside the buffer") {
    const auto errs = errors_on_ranks(2, [](local& c) {
      std::vector<std::size_t> sc{1, 1}, sd{0, 5}, rc{1, 1}, rd{0, 1};
      std::vector<int> s(2), r(2);
      c.all_to_allv(std::span<const int>(s), std::span<const std::size_t>(sc), std::span<const std::size_t>(sd),
                    std::span<int>(r), std::span<const std::size_t>(rc), std::span<const std::size_t>(rd));
    });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("outside the buffer"));
  }
  SECTION("reduce_scatter sizes") {
    const auto errs = errors_on_ranks(2, [](local& c) {
      std::vector<int> s(5), r(2);
      c.reduce_scatter(std::span<const int>(s), std::span<int>(r), loom::comm::reduce_op::sum);
    });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("reduce_scatter") && Catch::Contains("2 x 2"));
  }
  SECTION("broadcast roots that differ or are out of range") {
    auto errs = errors_on_ranks(3, [](local& c) {
      int v = 0;
      c.broadcast(std::span<int>(&v, 1), c.rank() == 2 ? 1 : 0);
    });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("root"));
    errs = errors_on_ranks(2, [](local& c) {
      int v = 0;
      c.broadcast(std::span<int>(&v, 1), 7);
    });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("root must be in [0, 2)"));
  }
  SECTION("reduce ops that differ") {
    const auto errs = errors_on_ranks(2, [](local& c) {
      int v = 1;
      c.all_reduce(std::span<const int>(&v, 1), std::span<int>(&v, 1),
                   c.rank() ? loom::comm::reduce_op::max : loom::comm::reduce_op::sum);
    });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("reduces with sum"));
  }
  SECTION("split with a negative color") {
    const auto errs = errors_on_ranks(2, [](local& c) { c.split(c.rank() - 1, 0); });
    for (const auto& e : errs) CHECK_THAT(e, Catch::Contains("color must be >= 0"));
  }
}

TEST_CASE("comm::local point-to-point size mismatch fails on both sides", "[comm][local][errors]") {
  const auto errs = errors_on_ranks(2, [](local& c) {
    std::vector<float> buf(c.rank() == 0 ? 10 : 9);
    if (c.rank() == 0) {
      auto q = c.isend(std::span<const float>(buf), 1, 3);
      c.wait(q);
    } else {
      auto q = c.irecv(std::span<float>(buf), 0, 3);
      c.wait(q);
    }
  });
  for (const auto& e : errs)
    CHECK_THAT(e, Catch::Contains("comm_failure|") && Catch::Contains("expects 9 x f32") && Catch::Contains("sent 10"));
}

TEST_CASE("comm::local point-to-point argument errors", "[comm][local][errors]") {
  // Rank threads only record what each call threw; the assertions run on the main thread (Catch's
  // macros are not thread-safe).
  std::vector<std::array<std::string, 3>> seen(2);
  run_local(2, [&](local& c) {
    float x = 0;
    auto thrown = [](auto&& call) -> std::string {
      try {
        call();
      } catch (const loom::error& e) {
        return std::string("loom::error: ") + e.what();
      } catch (...) {
        return "another exception";
      }
      return "no exception";
    };
    auto& s = seen[static_cast<std::size_t>(c.rank())];
    s[0] = thrown([&] { (void)c.isend(std::span<const float>(&x, 1), 2, 0); });
    s[1] = thrown([&] { (void)c.irecv(std::span<float>(&x, 1), -1, 0); });
    s[2] = thrown([&] { (void)c.isend(std::span<const float>(&x, 1), 0, -4); });
  });
  for (const auto& s : seen) {
    CHECK_THAT(s[0], Catch::StartsWith("loom::error"));
    CHECK_THAT(s[1], Catch::StartsWith("loom::error"));
    CHECK_THAT(s[2], Catch::StartsWith("loom::error") && Catch::Contains("tag must be >= 0"));
  }
  CHECK_THROWS_WITH(run_local(0, [](local&) {}), Catch::Contains("ranks must be >= 1"));
}

TEST_CASE("comm::local missing rank: the others time out naming the call", "[comm][local][errors][timeout]") {
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> seen(3);
  std::atomic<int> timed_out{0};
  try {
    run_local(3,
              [&](local& c) {
                try {
                  // Rank 1 arrives only after the others have timed out: late, but it returns in time
                  // for run_local (which waits one more timeout after the first failure).
                  if (c.rank() == 1)
                    while (timed_out.load() < 1) std::this_thread::sleep_for(ms(1));
                  c.barrier();
                } catch (const loom::error& e) {
                  seen[static_cast<std::size_t>(c.rank())] = std::string(loom::to_string(e.code())) + "|" + e.what();
                  if (e.code() == loom::errc::timeout) timed_out.fetch_add(1);
                  throw;
                }
              },
              {.timeout = ms(200)});
    FAIL("run_local should have thrown");
  } catch (const loom::error& e) {
    CHECK(e.code() == loom::errc::timeout);
    CHECK_THAT(e.what(), Catch::Contains("barrier") && Catch::Contains("timed out after 200 ms") &&
                             Catch::Contains("rank(s) 1 did not arrive"));
    CHECK_THAT(e.what(), !Catch::Contains("still running"));
  }
  CHECK_THAT(seen[1], Catch::StartsWith("comm_failure|") && Catch::Contains("aborted"));
  CHECK_THAT(seen[0], Catch::Contains("barrier"));
  CHECK_THAT(seen[2], Catch::Contains("barrier"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
}

TEST_CASE("comm::local point-to-point timeout names the wait", "[comm][local][errors][timeout]") {
  std::atomic<bool> timed_out{false};
  try {
    run_local(2,
              [&](local& c) {
                if (c.rank() == 0) {
                  float x = 0;
                  auto q = c.irecv(std::span<float>(&x, 1), 1, 4);
                  try {
                    c.wait(q);
                  } catch (...) {
                    timed_out = true;
                    throw;
                  }
                } else {
                  while (!timed_out.load()) std::this_thread::sleep_for(ms(1));  // never sends
                }
              },
              {.timeout = ms(150)});
    FAIL("run_local should have thrown");
  } catch (const loom::error& e) {
    CHECK(e.code() == loom::errc::timeout);
    CHECK_THAT(e.what(), Catch::Contains("irecv(src=1, tag=4") && Catch::Contains("timed out after 150 ms"));
    CHECK_THAT(e.what(), !Catch::Contains("still running"));
  }
}

TEST_CASE("comm::local rank that returned is reported at once", "[comm][local][errors]") {
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(run_local(3,
                              [](local& c) {
                                if (c.rank() != 2)
                                  c.all_reduce(std::span<const int>(), std::span<int>(), loom::comm::reduce_op::sum);
                              },
                              {.timeout = ms(60000)}),
                    Catch::Contains("all_reduce") && Catch::Contains("rank 2 returned without calling it"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
}

TEST_CASE("comm::local exception in one rank is rethrown and releases the others", "[comm][local][errors]") {
  const auto start = std::chrono::steady_clock::now();
  std::atomic<int> released{0};
  try {
    run_local(4,
              [&](local& c) {
                if (c.rank() == 2) throw std::runtime_error("boom on rank 2");
                try {
                  c.barrier();
                } catch (const loom::error& e) {
                  if (e.code() == loom::errc::comm_failure) released.fetch_add(1);
                  throw;
                }
              },
              {.timeout = ms(60000)});
    FAIL("run_local should have thrown");
  } catch (const loom::error&) {
    FAIL("the original exception should win over the released ranks' errors");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "boom on rank 2");
  }
  CHECK(released.load() == 3);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
}

TEST_CASE("comm::local request never waited on is an error", "[comm][local][errors]") {
  CHECK_THROWS_WITH(run_local(2,
                              [](local& c) {
                                static float x[2];
                                if (c.rank() == 0) {
                                  auto q = c.isend(std::span<const float>(&x[0], 1), 1, 0);
                                  (void)q;
                                } else {
                                  auto q = c.irecv(std::span<float>(&x[1], 1), 0, 0);
                                  c.wait(q);
                                }
                              }),
                    Catch::Contains("never waited on"));
}

TEST_CASE("comm::local returns per-rank results in rank order", "[comm][local]") {
  const auto v = run_local(7, [](local& c) { return c.rank() * 10 + c.size(); });
  REQUIRE(v.size() == 7);
  for (int q = 0; q < 7; ++q) CHECK(v[static_cast<std::size_t>(q)] == q * 10 + 7);
}

TEST_CASE("comm::local rejects a timeout that is not positive", "[comm][local][errors][timeout]") {
  CHECK_THROWS_WITH(run_local(2, [](local&) {}, {.timeout = ms(0)}), Catch::Contains("timeout must be > 0 ms, got 0"));
  CHECK_THROWS_WITH(run_local(2, [](local&) {}, {.timeout = ms(-5)}), Catch::Contains("timeout must be > 0 ms"));
}

TEST_CASE("comm::local timeout of milliseconds::max() does not overflow the deadline", "[comm][local][timeout]") {
  const auto v =
      run_local(3,
                [](local& c) {
                  c.barrier();
                  int x = c.rank(), sum = 0;
                  c.all_reduce(std::span<const int>(&x, 1), std::span<int>(&sum, 1), loom::comm::reduce_op::sum);
                  return sum;
                },
                {.timeout = ms::max()});
  for (int s : v) CHECK(s == 3);
}

namespace {
// The stuck rank of the next test touches only these: its thread outlives run_local.
std::atomic<bool> stuck_release{false}, stuck_left{false};
}  // namespace

TEST_CASE("comm::local rank that never returns is reported by run_local", "[comm][local][errors][timeout]") {
  stuck_release = false;
  stuck_left = false;
  // A function object that outlives the test too: the detached thread is still inside it.
  static const auto fn = [](local& c) {
    if (c.rank() == 1) {
      while (!stuck_release.load()) std::this_thread::sleep_for(ms(5));  // stuck outside loom
      stuck_left = true;
      return;
    }
    c.barrier();
  };
  const auto start = std::chrono::steady_clock::now();
  try {
    run_local(3, fn, {.timeout = ms(200)});
    FAIL("run_local should have thrown");
  } catch (const loom::error& e) {
    CHECK(e.code() == loom::errc::timeout);
    CHECK_THAT(e.what(), Catch::Contains("rank(s) 1 still running 200 ms after the first failure") &&
                             Catch::Contains("barrier") && Catch::Contains("detached"));
  }
  // About two timeouts (the barrier's, then run_local's), far from forever.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  stuck_release = true;
  for (int i = 0; i < 2000 && !stuck_left.load(); ++i) std::this_thread::sleep_for(ms(1));
  CHECK(stuck_left.load());
  std::this_thread::sleep_for(ms(20));  // let the detached thread finish its bookkeeping
}

TEST_CASE("comm::local waiting a request again, or a copy of it, counts once", "[comm][local][errors]") {
  SECTION("a copy waited after the original is a no-op") {
    const auto got = run_local(2, [](local& c) {
      int x = 41 + c.rank(), y = -1;
      if (c.rank() == 0) {
        auto a = c.isend(std::span<const int>(&x, 1), 1, 0);
        auto b = a;
        c.wait(a);
        c.wait(b);  // no second decrement of the outstanding count
        c.wait(a);
        return (a.valid() || b.valid()) ? -2 : 0;
      }
      auto q = c.irecv(std::span<int>(&y, 1), 0, 0);
      c.wait(q);
      return y;
    });
    CHECK(got[0] == 0);
    CHECK(got[1] == 41);
  }
  SECTION("so a later request that was never waited on is still reported") {
    CHECK_THROWS_WITH(run_local(2,
                                [](local& c) {
                                  static int x[3];
                                  if (c.rank() == 0) {
                                    auto a = c.isend(std::span<const int>(&x[0], 1), 1, 0);
                                    auto b = a;
                                    c.wait(a);
                                    c.wait(b);
                                    auto later = c.isend(std::span<const int>(&x[1], 1), 1, 1);
                                    (void)later;
                                  } else {
                                    auto q = c.irecv(std::span<int>(&x[2], 1), 0, 0);
                                    c.wait(q);
                                  }
                                }),
                      Catch::Contains("rank 0 returned with 1 request(s) it never waited on"));
  }
}

TEST_CASE("comm::local send and receive buffers that overlap are rejected", "[comm][local][errors]") {
  // Each rank records what its waits threw; the assertions run on the main thread.
  auto waits = [](local& c, local::request& s, local::request& r) {
    std::string out;
    for (auto* q : {&s, &r}) {
      try {
        c.wait(*q);
        out += "ok;";
      } catch (const loom::error& e) {
        out += std::string(loom::to_string(e.code())) + "|" + e.what() + ";";
      }
    }
    return out;
  };
  SECTION("a self-send whose receive overlaps the send") {
    const auto seen = run_local(1, [&](local& c) {
      std::vector<int> v(8, 3);
      auto r = c.irecv(std::span<int>(v.data() + 2, 6), 0, 5);
      auto s = c.isend(std::span<const int>(v.data(), 6), 0, 5);
      return waits(c, s, r);
    });
    CHECK_THAT(seen[0], Catch::StartsWith("invalid_argument|") && Catch::Contains("isend(dest=0, tag=5) on rank 0") &&
                            Catch::Contains("receive buffer overlaps the send buffer (24 B each)") &&
                            Catch::Contains(";invalid_argument|"));
  }
  SECTION("a self-send in place") {
    const auto seen = run_local(1, [&](local& c) {
      double d[4] = {};
      auto s = c.isend(std::span<const double>(d, 4), 0, 1);
      auto r = c.irecv(std::span<double>(d, 4), 0, 1);
      return waits(c, s, r);
    });
    CHECK_THAT(seen[0], Catch::StartsWith("invalid_argument|") && Catch::Contains("overlaps"));
  }
  SECTION("two ranks sharing memory") {
    static float shared[6];
    const auto seen = run_local(2, [&](local& c) -> std::string {
      if (c.rank() == 0) {
        auto s = c.isend(std::span<const float>(shared, 4), 1, 2);
        try {
          c.wait(s);
        } catch (const loom::error& e) {
          return e.what();
        }
        return "no exception";
      }
      auto r = c.irecv(std::span<float>(shared + 2, 4), 0, 2);
      try {
        c.wait(r);
      } catch (const loom::error& e) {
        return e.what();
      }
      return "no exception";
    });
    for (const auto& s : seen) CHECK_THAT(s, Catch::Contains("irecv(src=0) on rank 1") && Catch::Contains("overlaps"));
  }
  SECTION("adjacent buffers are fine") {
    const auto seen = run_local(1, [&](local& c) {
      std::vector<int> v{1, 2, 3, 4};
      auto r = c.irecv(std::span<int>(v.data() + 2, 2), 0, 5);
      auto s = c.isend(std::span<const int>(v.data(), 2), 0, 5);
      return waits(c, s, r) + std::to_string(v[2]) + std::to_string(v[3]);
    });
    CHECK(seen[0] == "ok;ok;12");
  }
}

namespace {
// Sets an environment variable for one scope and restores it after.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    had_ = std::getenv(name) != nullptr;
    ::setenv(name, value, 1);
  }
  ~scoped_env() {
    if (had_)
      ::setenv(name_, old_.c_str(), 1);
    else
      ::unsetenv(name_);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};
}  // namespace

TEST_CASE("LOOM_COMM_TIMEOUT_MS must be a plain positive integer", "[comm][local][errors][timeout]") {
  {
    scoped_env env("LOOM_COMM_TIMEOUT_MS", "250");
    CHECK(loom::comm::default_timeout() == ms(250));
    CHECK(loom::comm::local_options{}.timeout == ms(250));
  }
  for (const char* bad : {"1e3", "5s", "0", "-1", "+7", " 10", "10 ", "", "0x10", "1.5", "12345678901234567890"}) {
    INFO("LOOM_COMM_TIMEOUT_MS=\"" << bad << "\"");
    scoped_env env("LOOM_COMM_TIMEOUT_MS", bad);
    try {
      (void)loom::comm::default_timeout();
      FAIL("no exception");
    } catch (const loom::error& e) {
      CHECK(e.code() == loom::errc::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains("LOOM_COMM_TIMEOUT_MS must be a plain positive integer") &&
                               Catch::Contains(std::string("got \"") + bad + "\""));
    }
    // The default options read it too, so run_local rejects it before starting any rank.
    CHECK_THROWS_WITH(run_local(2, [](local&) {}), Catch::Contains("LOOM_COMM_TIMEOUT_MS"));
    CHECK_NOTHROW(run_local(2, [](local&) {}, {.timeout = ms(1000)}));
  }
}

// The deadline-polled wait of the device communicators (comm::nccl's wait, synchronize, barrier,
// init_rank): done, an asynchronous failure, a timeout; the abort runs once on each failure path.
TEST_CASE("device waits: polling against a deadline aborts and names the call", "[comm][timeout]") {
  using loom::comm::detail::poll_state;
  int polls = 0, aborts = 0;
  loom::comm::detail::poll_until_done(
      "comm::test wait", ms(1000), [&](std::string&) { return ++polls < 3 ? poll_state::pending : poll_state::done; },
      [&] { ++aborts; });
  CHECK(polls == 3);
  CHECK(aborts == 0);
  try {
    loom::comm::detail::poll_until_done(
        "comm::test wait", ms(1000),
        [&](std::string& m) {
          m = "NCCL reports unhandled system error";
          return poll_state::failed;
        },
        [&] { ++aborts; });
    FAIL("a failed poll must throw");
  } catch (const loom::error& e) {
    CHECK(e.code() == loom::errc::comm_failure);
    CHECK_THAT(e.what(), Catch::Contains("comm::test wait: NCCL reports unhandled system error"));
  }
  CHECK(aborts == 1);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    loom::comm::detail::poll_until_done(
        "comm::test synchronize", ms(50), [&](std::string&) { return poll_state::pending; }, [&] { ++aborts; });
    FAIL("a poll that never completes must time out");
  } catch (const loom::error& e) {
    CHECK(e.code() == loom::errc::timeout);
    CHECK_THAT(e.what(),
               Catch::Contains("comm::test synchronize: timed out after 50 ms") && Catch::Contains("aborted"));
  }
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(aborts == 2);
  CHECK(waited >= ms(50));
  CHECK(waited < std::chrono::seconds(5));
}

// comm::standin has NCCL's semantics: an isend and an irecv are separate operations of one stream,
// so two ranks that both send first block each other, and the wait reports it within the timeout
// (a GPU would hang); the grouped sendrecv is the ring step.
TEST_CASE("comm::standin: ungrouped sends of both ranks time out, sendrecv completes", "[comm][standin][timeout]") {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> seen(2);
  loom::comm::standin_options opt;
  opt.local.timeout = ms(200);
  try {
    loom::comm::run_standin(
        2,
        [&](loom::comm::standin& c, loom::standin) {
          std::vector<int> out(4, c.rank()), in(4, -1);
          try {
            auto s = c.isend(std::span<const int>(out), 1 - c.rank(), 0);
            auto r = c.irecv(std::span<int>(in), 1 - c.rank(), 0);
            c.wait(s);
            c.wait(r);
          } catch (const loom::error& e) {
            seen[static_cast<std::size_t>(c.rank())] = std::string(loom::to_string(e.code())) + "|" + e.what();
            throw;
          }
        },
        opt);
    FAIL("both ranks sending first must fail");
  } catch (const loom::error& e) {
    CHECK((e.code() == loom::errc::timeout || e.code() == loom::errc::comm_failure));
  }
  for (const auto& w : seen) {
    INFO(w);
    CHECK((w.find("timed out") != std::string::npos || w.find("aborted") != std::string::npos));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  std::vector<int> got(2, -1);
  loom::comm::run_standin(2, [&](loom::comm::standin& c, loom::standin) {
    std::array<int, 3> out{c.rank(), c.rank(), c.rank()}, in{-1, -1, -1};
    c.sendrecv(std::span<const int>(out), 1 - c.rank(), std::span<int>(in), 1 - c.rank(), 0);
    c.synchronize();
    got[static_cast<std::size_t>(c.rank())] = in[0] + in[1] + in[2];
  });
  CHECK(got == std::vector<int>{3, 0});
}

// A request's event orders a compute stream after the transfer without blocking the host: rank 0
// sends 1000 ones, rank 1 waits for the receive on its compute stream (wait(request, b)) and sums
// them there. Returns what the rank summed (0 on the sender).
template <class C>
double received_sum(C& c, const loom::standin& b) {
  const int me = c.rank();
  std::vector<double> data(1000, me == 0 ? 1.0 : 0.0), into(1000, 0.0);
  double total = 0;
  if (me == 0) {
    auto s = c.isend(std::span<const double>(data), 1, 0);
    c.wait(s);
  } else {
    auto r = c.irecv(std::span<double>(into), 0, 0);
    c.wait(r, b);  // the kernel below runs after the receive
    loom::for_each_index(b, 1, [&, p = into.data()](loom::index_t) {
      for (int i = 0; i < 1000; ++i) total += p[i];
    });
    loom::fence(b);
  }
  return total;
}

TEST_CASE("comm::standin: wait(request, b) orders the compute stream after the receive", "[comm][standin]") {
  std::array<double, 2> sum{-1, -1};
  loom::comm::standin_options opt;
  opt.max_delay = std::chrono::microseconds(300);
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    opt.seed = seed;
    loom::comm::run_standin(
        2,
        [&](loom::comm::standin& c, loom::standin b) { sum[static_cast<std::size_t>(c.rank())] = received_sum(c, b); },
        opt);
    INFO("seed " << seed);
    CHECK(sum[1] == 1000.0);
  }
}

// The conformance cases a communicator with NCCL's semantics must pass (every collective and the
// grouped sendrecv), on the stand-in's stream-ordered communicator with random stream delays.
TEST_CASE("comm::standin conforms (collectives, sendrecv, split) for P = 1..5", "[comm][standin]") {
  const int p = GENERATE(range(1, 6));
  std::vector<rank_report> reports(static_cast<std::size_t>(p));
  loom::comm::standin_options opt;
  opt.seed = static_cast<std::uint64_t>(p);
  opt.max_delay = std::chrono::microseconds(50);
  loom::comm::run_standin(
      p,
      [&](loom::comm::standin& c, loom::standin) {
        loom::test::stream_conformance_suite(c, reports[static_cast<std::size_t>(c.rank())]);
      },
      opt);
  check_reports(reports, p);
}

// comm::device_local's protocol (the one a single GPU runs) on the CPU stand-in: the stream-ordered
// conformance cases with random delays on every stream, 10 seeds per P.
TEST_CASE("device_local protocol on the stand-in conforms (collectives, sendrecv, split) for P = 1..5",
          "[comm][standin][device_local]") {
  const int p = GENERATE(range(1, 6));
  const std::uint64_t seeds = loom::test::sanitized ? 3 : 10;  // sanitizer builds: 3 seeds per P
  for (std::uint64_t seed = 0; seed < seeds; ++seed) {
    INFO("P = " << p << ", seed " << seed);
    std::vector<rank_report> reports(static_cast<std::size_t>(p));
    loom::test::run_standin_device(p,
                                   [&](auto& c, loom::standin) {
                                     loom::test::stream_conformance_suite(c,
                                                                          reports[static_cast<std::size_t>(c.rank())]);
                                   },
                                   {.seed = seed, .max_delay = std::chrono::microseconds(seed % 2 ? 100 : 10)});
    check_reports(reports, p);
  }
}

// Its point-to-point semantics: a send returns once its receive was issued, so two ranks that both
// send first wait for each other until the timeout; a request orders compute after the receive.
TEST_CASE("device_local protocol on the stand-in: ungrouped sends time out, a request orders compute",
          "[comm][standin][device_local][timeout]") {
  const auto t0 = std::chrono::steady_clock::now();
  loom::comm::device_local_options opt;
  opt.local.timeout = ms(200);
  std::vector<std::string> seen(2);
  CHECK_THROWS(loom::test::run_standin_device(
      2,
      [&](auto& c, loom::standin) {
        std::vector<int> out(4, c.rank()), in(4, -1);
        try {
          auto s = c.isend(std::span<const int>(out), 1 - c.rank(), 0);
          auto r = c.irecv(std::span<int>(in), 1 - c.rank(), 0);
          c.wait(s);
          c.wait(r);
        } catch (const loom::error& e) {
          seen[static_cast<std::size_t>(c.rank())] = e.what();
          throw;
        }
      },
      {}, opt));
  for (const auto& w : seen) {
    INFO(w);
    CHECK((w.find("timed out") != std::string::npos || w.find("aborted") != std::string::npos));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    std::array<double, 2> sum{-1, -1};
    loom::test::run_standin_device(
        2, [&](auto& c, loom::standin b) { sum[static_cast<std::size_t>(c.rank())] = received_sum(c, b); },
        {.seed = seed, .max_delay = std::chrono::microseconds(300)});
    INFO("seed " << seed);
    CHECK(sum[1] == 1000.0);
  }
}

TEST_CASE("device_local protocol: an all_to_allv whose send and recv overlap is rejected on the calling rank",
          "[comm][standin][device_local][errors]") {
  std::string what;
  loom::test::run_standin_device(1,
                                 [&](auto& c, loom::standin) {
                                   std::vector<float> x(4);
                                   const std::array<std::size_t, 1> n{4}, z{0};
                                   try {
                                     c.all_to_allv(std::span<const float>(x), std::span<const std::size_t>(n),
                                                   std::span<const std::size_t>(z), std::span<float>(x),
                                                   std::span<const std::size_t>(n), std::span<const std::size_t>(z));
                                   } catch (const loom::error& e) {
                                     what = e.what();
                                   }
                                 },
                                 {});
  CHECK_THAT(what, Catch::Contains("comm::device_local all_to_allv: send and recv must not overlap"));
}
