#pragma once

// comm::device_local's protocol on the CPU device stand-in: standin_device is the device policy of
// comm::basic_device_local (comm/detail/device_local_impl.hpp) over stand-in streams and events,
// so the protocol a single GPU runs (host meetings, ready / done events, device-to-device copies,
// rank-ordered reductions) runs on the CPU with random stream delays, under TSan.
//   loom::test::run_standin_device(p, [](auto& comm, loom::standin b) { ... }, options);

#include <loom/backend/standin.hpp>
#include <loom/comm/detail/device_local_impl.hpp>
#include <loom/comm/local.hpp>

#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

namespace loom::test {

class standin_device {
 public:
  using backend = loom::standin;
  using memory_space = loom::standin_memory;
  using stream = loom::standin_stream*;
  using event = loom::standin_event;

  explicit standin_device(loom::standin_stream* s) : s_(s) {}
  [[nodiscard]] loom::standin_stream* stream_of() const noexcept { return s_; }
  event record() {
    event e;
    e.record(*s_);
    return e;
  }
  event record_on(const loom::standin& b) {
    event e;
    e.record(b.queue());
    return e;
  }
  void wait(const event& e) { s_->wait_event(e); }
  void wait_on(const loom::standin& b, const event& e) { b.queue().wait_event(e); }
  void copy(void* dst, const void* src, std::size_t bytes) { loom::standin_memcpy(on(), dst, src, bytes); }
  void* scratch(std::size_t bytes) { return ::operator new(bytes > 0 ? bytes : 1); }
  void release(void* p) {
    s_->enqueue([p] { ::operator delete(p); });
  }
  [[nodiscard]] loom::standin on() const noexcept { return {s_}; }
  loom::comm::detail::poll_state state(const event& e, std::string& why) const {
    if (!e.query()) return loom::comm::detail::poll_state::pending;
    try {
      e.synchronize();
    } catch (const std::exception& x) {
      why = x.what();
      return loom::comm::detail::poll_state::failed;
    }
    return loom::comm::detail::poll_state::done;
  }

 private:
  loom::standin_stream* s_;
};

using standin_device_local = loom::comm::basic_device_local<standin_device>;

//! Runs fn(comm, b) on p rank threads: b a stand-in compute stream of the rank, comm the
//! device_local protocol on a communication stream of its own, both with random delays. Every
//! rank's streams live until every rank has returned and every stream has drained: a rank's
//! stream waits on events of its peers' streams (as a GPU's streams wait on each other's events).
template <class F>
void run_standin_device(int p, F&& fn, loom::standin_delays delays, loom::comm::device_local_options opt = {}) {
  std::vector<std::unique_ptr<loom::standin_stream>> compute, transfer;
  for (int r = 0; r < p; ++r) {
    const auto u = static_cast<std::uint64_t>(r);
    compute.push_back(std::make_unique<loom::standin_stream>(
        loom::standin_delays{.seed = delays.seed * 1000003 + 2 * u, .max_delay = delays.max_delay}));
    transfer.push_back(std::make_unique<loom::standin_stream>(
        loom::standin_delays{.seed = delays.seed * 1000003 + 2 * u + 1, .max_delay = delays.max_delay}));
  }
  struct drain_all {
    std::vector<std::unique_ptr<loom::standin_stream>>&a, &b;
    ~drain_all() {
      for (auto* v : {&a, &b})
        for (auto& s : *v) s->drain();
    }
  } guard{compute, transfer};
  loom::comm::run_local(
      p,
      [&](loom::comm::local& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        standin_device_local comm(c, transfer[r].get(), opt);
        fn(comm, loom::standin{compute[r].get()});
        comm.synchronize();
        compute[r]->synchronize();
      },
      opt.local);
}

}  // namespace loom::test
