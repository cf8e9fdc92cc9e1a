#pragma once

// Ranks for a distributed test body swept over backends (loom_add_backend_test ... BACKENDS serial
// standin): the same body runs on host memory (loom::serial per rank, comm::local) and on the device
// stand-in (a loom::standin policy with a stream of its own per rank, comm::standin with its own
// communication stream, random delays on both), so the device schedule of every distributed
// primitive runs on the CPU.
//   loom::test::run_ranks(p, [&](auto& comm, const auto& b) { ... })
//   loom::test::errors_on_ranks_of(p, fn)          what each rank threw (loom::error::what())
//   loom::test::dview<T, R>(ptr, ext), dview_t<T, R>  a view of host storage typed in the backend's space
//   loom::test::docs_in_space(offsets)             segments in that space (int32 or int64)
// A rank must fence its backend before the storage its calls use goes out of scope or is read
// (loom::fence(b); a no-op on host backends), as a device program frees or reads device memory.

#include <loom/comm/counting.hpp>
#include <loom/comm/local.hpp>
#include <loom/core/segments.hpp>

#include <support/allocations.hpp>
#include <support/backends.hpp>

#if defined(LOOM_TEST_BACKEND_STANDIN)
#include <loom/comm/standin.hpp>
#endif

#include <array>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace loom::test {

//! True when the ranks run on the device stand-in (sanitizer builds trim their largest cases there).
#if defined(LOOM_TEST_BACKEND_STANDIN)
inline constexpr bool standin_ranks_run = true;
#else
inline constexpr bool standin_ranks_run = false;
#endif

#if defined(LOOM_TEST_BACKEND_STANDIN)
//! The delays of the ranks' streams: LOOM_STANDIN_SEED, LOOM_STANDIN_MAX_DELAY_US (default 20 us).
inline loom::comm::standin_options standin_ranks(std::uint64_t seed_offset = 0) {
  const char* d = std::getenv("LOOM_STANDIN_MAX_DELAY_US");
  const char* s = std::getenv("LOOM_STANDIN_SEED");
  loom::comm::standin_options o;
  o.seed = (s != nullptr ? std::strtoull(s, nullptr, 10) : 1u) + seed_offset;
  o.max_delay = std::chrono::microseconds(d != nullptr ? std::atoll(d) : 20);
  return o;
}
//! When set, the options every run_ranks uses (a delay-injection test sweeps its seeds).
inline std::optional<loom::comm::standin_options>& standin_override() {
  static std::optional<loom::comm::standin_options> o;
  return o;
}
template <class F>
void run_ranks(int p, F&& fn) {
  const auto opt = standin_override() ? *standin_override() : standin_ranks();
  loom::comm::run_standin(
      p, [&](loom::comm::standin& comm, loom::standin b) { fn(comm, b); }, opt);
}
template <class F>
void run_ranks(int p, F&& fn, loom::comm::standin_options opt) {
  loom::comm::run_standin(
      p, [&](loom::comm::standin& comm, loom::standin b) { fn(comm, b); }, opt);
}
#else
template <class F>
void run_ranks(int p, F&& fn) {
  loom::comm::run_local(p, [&](loom::comm::local& comm) { fn(comm, make_backend()); });
}
#endif

//! A policy for a second host thread of one rank: serial on host memory; on the stand-in, a
//! stream of its own (as a second host thread would use on a device).
#if defined(LOOM_TEST_BACKEND_STANDIN)
class thread_backend {
 public:
  loom::standin policy() { return {&s_}; }

 private:
  loom::standin_stream s_{standin_ranks_delays()};
  static loom::standin_delays standin_ranks_delays() {
    const auto o = standin_ranks(7);
    return {.seed = o.seed, .max_delay = o.max_delay};
  }
};
//! The rank's communicator with its traffic counted (comm::counting); on the stand-in, the
//! operations run on the communication stream's thread, so the rank thread's allocation count
//! never sees the underlying comm::local.
inline loom::comm::counting<loom::comm::standin> counted(loom::comm::standin& c) {
  return loom::comm::counting<loom::comm::standin>(c);
}
#else
class thread_backend {
 public:
  backend_under_test policy() { return make_backend(); }
};
//! The rank's communicator with its traffic counted, and comm::local's own allocations not
//! counted against the rank (support/allocations.hpp).
inline loom::comm::counting<uncounted<loom::comm::local> > counted(loom::comm::local& c) {
  return loom::comm::counting<uncounted<loom::comm::local> >(uncounted<loom::comm::local>(c));
}
#endif

//! Runs fn(comm, b) on p ranks; element r is what rank r threw (loom::error::what()), or empty.
template <class F>
std::vector<std::string> errors_on_ranks_of(int p, F&& fn) {
  std::vector<std::string> what(static_cast<std::size_t>(p));
  run_ranks(p, [&](auto& comm, const auto& b) {
    try {
      fn(comm, b);
    } catch (const loom::error& e) {
      what[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return what;
}

//! Waits for the work a rank enqueued on b, without looking at its errors: before a rank's storage
//! goes out of scope on an error path (on the stand-in; nothing to wait for on host backends).
template <class B>
void drain(const B& b) noexcept {
  if constexpr (requires { b.queue().drain(); }) b.queue().drain();
}

//! A view type in the memory space of the backend under test.
template <class T, std::size_t R>
using dview_t = tensor_view<T, R, space>;

//! A view of host storage typed in the memory space of the backend under test.
template <class T, std::size_t R>
tensor_view<T, R, space> dview(T* data, const std::array<index_t, R>& ext) {
  return tensor_view<T, R, space>(data, ext);
}

//! Offsets (int32 or int64, host storage) as segments in the backend's space.
template <class I>
loom::segments<space> docs_in_space(const std::vector<I>& offsets) {
  return loom::segments<space>(tensor_view<const I, 1, space>(offsets.data(), {static_cast<index_t>(offsets.size())}));
}

}  // namespace loom::test
