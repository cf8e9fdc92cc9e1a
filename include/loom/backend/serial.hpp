#pragma once

//! @file
//! loom::serial: one host thread, in order. The reference every other backend is tested against.

#include <loom/backend/detail/parallel_serial.hpp>
#include <loom/backend/traits.hpp>

namespace loom {

//! Runs everything on the calling thread, in index order.
struct serial {};

template <>
struct backend_traits<serial> {
  using memory_space = host_memory;
  static constexpr std::string_view name() noexcept { return "serial"; }
  static void fence(const serial&) noexcept {}
  static int concurrency(const serial&) noexcept { return 1; }
};

}  // namespace loom
