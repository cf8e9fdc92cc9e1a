#pragma once

//! @file
//! The timeout shared by the host communicators (comm::local, comm::mpi): its default from
//! LOOM_COMM_TIMEOUT_MS, strictly parsed, and deadlines that cannot overflow the clock.

#include <loom/core/error.hpp>

#include <chrono>
#include <cstdlib>
#include <string>

namespace loom::comm {

namespace detail {

using clock = std::chrono::steady_clock;

//! Parses the value of LOOM_COMM_TIMEOUT_MS: a plain positive integer of milliseconds (decimal
//! digits only: no sign, blanks, exponent or unit). "1e3" would otherwise read as 1 ms.
//! @throws loom::error(invalid_argument) naming the variable and the value.
inline std::chrono::milliseconds parse_timeout_ms(const char* name, const char* value) {
  const std::string v(value);
  long long ms = 0;
  bool ok = !v.empty() && v.size() <= 15;  // up to ~31,000 years: no overflow below
  for (std::size_t i = 0; ok && i < v.size(); ++i) {
    if (v[i] < '0' || v[i] > '9')
      ok = false;
    else
      ms = ms * 10 + (v[i] - '0');
  }
  if (!ok || ms <= 0)
    throw error(errc::invalid_argument, std::string(name) +
                                            " must be a plain positive integer of milliseconds (at most " +
                                            "15 digits), got \"" + v + "\"");
  return std::chrono::milliseconds(ms);
}

//! now + timeout, saturated: a huge timeout (milliseconds::max() for "practically forever")
//! must not overflow the clock's nanosecond count.
inline clock::time_point deadline_after(std::chrono::milliseconds timeout, clock::time_point from = clock::now()) {
  constexpr auto cap = std::chrono::hours(24 * 365 * 100);
  return from + (timeout > cap ? std::chrono::duration_cast<clock::duration>(cap)
                               : std::chrono::duration_cast<clock::duration>(timeout));
}

}  // namespace detail

//! The timeout every host communicator uses when none is given: LOOM_COMM_TIMEOUT_MS from the
//! environment (a plain positive integer of milliseconds), else 120 s.
//! @throws loom::error(invalid_argument) naming the variable and its value when it is set to
//! anything else ("1e3", "5s", "0", "-1", " 10", "").
inline std::chrono::milliseconds default_timeout() {
  if (const char* env = std::getenv("LOOM_COMM_TIMEOUT_MS"))
    return detail::parse_timeout_ms("LOOM_COMM_TIMEOUT_MS", env);
  return std::chrono::milliseconds(120000);
}

}  // namespace loom::comm
