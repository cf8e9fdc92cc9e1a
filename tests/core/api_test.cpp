// The vocabulary every family shares: loom::segments (int32 and int64 offsets, one validation),
// loom::accum_t, workspaces (alignment, layout, checks) and the allocation counters the
// no-allocation tests of every family rely on.
#include <loom/backend/serial.hpp>
#include <loom/backend/temporary.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/segments.hpp>
#include <loom/core/workspace.hpp>

#include <support/allocations.hpp>
#include <support/errors.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <span>
#include <vector>

static_assert(std::is_same_v<loom::accum_t<loom::bfloat16>, float>);
static_assert(std::is_same_v<loom::accum_t<loom::half>, float>);
static_assert(std::is_same_v<loom::accum_t<float>, float>);
static_assert(std::is_same_v<loom::accum_t<const double>, double>);
static_assert(std::is_same_v<loom::default_precision<loom::bfloat16>, loom::bf16>);

TEST_CASE("segments: int32 and int64 offsets give the same documents", "[core][segments]") {
  const std::vector<std::int32_t> c32 = {0, 5, 5, 12, 17};
  const std::vector<std::int64_t> c64 = {0, 5, 5, 12, 17};
  const loom::segments a{std::span<const std::int32_t>(c32)};
  const loom::segments b{std::span<const std::int64_t>(c64)};
  const auto view = loom::make_view(c64.data(), std::array<loom::index_t, 1>{5});
  const loom::segments c{view};
  CHECK(!a.wide());
  CHECK(b.wide());
  CHECK(a.count() == 4);
  CHECK(c.count() == 4);
  for (loom::index_t t = 0; t < 17; ++t) {
    const loom::index_t expect = t < 5 ? 1 : t < 12 ? 2 : 3;  // document 1 is empty: t = 5 is in 2
    CHECK(a.of(t) == (t < 5 ? 0 : expect));
    CHECK(b.of(t) == a.of(t));
    CHECK(c.of(t) == a.of(t));
  }
  CHECK(a.length(1) == 0);
  CHECK(a.length(3) == 5);
  const auto checked = loom::check_segments(a, 17, "t");
  CHECK(checked.count() == 4);
}

TEST_CASE("segments: implicit segments are one document bound to the token count", "[core][segments]") {
  const auto s = loom::check_segments(loom::segments<>{}, 13, "t");
  CHECK(s.implicit());
  CHECK(s.count() == 1);
  CHECK(s[0] == 0);
  CHECK(s[1] == 13);
  CHECK(s.of(12) == 0);
}

TEST_CASE("segments: each invalid offset table is rejected by name", "[core][segments]") {
  using loom::errc;
  using loom::test::require_loom_error;
  const std::vector<std::int32_t> bad0 = {1, 5}, dec = {0, 7, 3, 9}, last = {0, 4, 11}, none = {};
  require_loom_error([&] { (void)loom::check_segments(loom::segments{std::span(bad0)}, 5, "call", "docs"); },
                     errc::invalid_argument, {"call", "docs[0] must be 0"});
  require_loom_error([&] { (void)loom::check_segments(loom::segments{std::span(dec)}, 9, "call"); },
                     errc::invalid_argument, {"cu_seqlens must be non-decreasing", "cu_seqlens[2] = 3"});
  require_loom_error([&] { (void)loom::check_segments(loom::segments{std::span(last)}, 12, "call"); },
                     errc::invalid_argument, {"cu_seqlens[2]", "token count 12", "got 11"});
  require_loom_error([&] { (void)loom::check_segments(loom::segments{std::span(none)}, 0, "call"); },
                     errc::invalid_argument, {"at least one offset"});
  const std::vector<std::int64_t> strided = {0, 99, 3, 99, 7};
  const loom::tensor_view<const std::int64_t, 1> sv(strided.data(), {3}, {2});
  require_loom_error([&] { (void)loom::segments{sv}; }, errc::invalid_argument, {"contiguous"});
}

TEST_CASE("workspace: layouts align every buffer and calls check size and alignment", "[core][workspace]") {
  loom::workspace_layout l;
  CHECK(l.add<float>(3) == 0);
  CHECK(l.add<double>(17) == 64);
  CHECK(l.add<char>(0) == 64 + 192);
  CHECK(l.bytes() == 64 + 192);
  loom::workspace_buffer ws(l.bytes() + 1);
  CHECK(reinterpret_cast<std::uintptr_t>(ws.data()) % loom::workspace_alignment == 0);
  loom::check_workspace(ws.span(), l.bytes(), "call");
  using loom::test::require_loom_error;
  require_loom_error([&] { loom::check_workspace(ws.span().first(10), 64, "call"); }, loom::errc::invalid_argument,
                     {"call", "at least 64 bytes", "got 10"});
  require_loom_error([&] { loom::check_workspace(ws.span().subspan(1), 64, "call"); }, loom::errc::invalid_argument,
                     {"call", "64-byte boundary"});
  loom::workspace_carver carve(ws.span());
  float* f = carve.take<float>(3);
  double* d = carve.take<double>(17);
  CHECK(reinterpret_cast<std::byte*>(d) - reinterpret_cast<std::byte*>(f) == 64);
}

TEST_CASE("allocation counters see heap allocations and temporaries on this thread", "[core][workspace]") {
  const auto none = loom::test::count_allocations([] {});
  CHECK(none.heap == 0);
  CHECK(none.temporaries == 0);
  const auto some = loom::test::count_allocations([] {
    loom::temporary_buffer<loom::serial, float> t(loom::serial{}, 7);
    CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % loom::workspace_alignment == 0);
    std::vector<int> v(3);
    CHECK(v.size() == 3);
  });
  CHECK(some.heap == 2);
  CHECK(some.temporaries == 1);
  const auto paused = loom::test::count_allocations([] {
    loom::test::uncounted_scope s;
    std::vector<int> v(3);
    CHECK(v.size() == 3);
  });
  CHECK(paused.heap == 0);
}
