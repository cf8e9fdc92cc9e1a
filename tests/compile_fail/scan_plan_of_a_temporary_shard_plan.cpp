// expect: use of deleted function
// A cross-rank scan plan views its shard plan's offsets: a temporary shard plan would dangle.
#include <loom/backend/serial.hpp>
#include <loom/comm/local.hpp>
#include <loom/scan/distributed.hpp>

#include <cstdint>
#include <vector>

void f(loom::comm::local& comm) {
  const std::vector<std::int64_t> cu{0, 10};
  (void)loom::scan::make_plan(
      loom::serial{}, comm, loom::scan::plus<float>{},
      loom::shard::make_plan(loom::segments<>(std::span<const std::int64_t>(cu)), 2, loom::shard::contiguous{}));
}
