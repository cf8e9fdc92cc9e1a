#pragma once

//! @file
//! How a distributed primitive orders its compute and its communication, for every pair of
//! backend and communicator (the execution model of docs/api.md):
//!
//!   loom::comm::handoff(b, comm);     // compute -> communication
//!   comm.all_gather(mine, theirs);    // buffers in the backend's memory space
//!   loom::comm::handback(b, comm);    // communication -> compute
//!
//! A host communicator (local, mpi, counting over them) completes every call on return, so
//! handoff fences the backend (its results must be in memory before the communicator reads them)
//! and handback does nothing. A stream-ordered communicator (comm::standin, comm::nccl) runs its
//! operations on a communication stream: handoff makes that stream wait for the work the backend
//! has enqueued so far, handback makes the backend's stream wait for the communication enqueued so
//! far. Neither blocks the host, so a device call returns with its compute and transfers queued.
//!
//! Control-plane messages (the cross-rank agreement of make_plan, on host memory, needed on the
//! host before make_plan returns) go through host_all_gather, which every communicator serves.

#include <loom/backend/traits.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/core/memory_space.hpp>

#include <span>
#include <type_traits>

namespace loom::comm {

//! The memory space a communicator's buffers must be in: C::memory_space for a device
//! communicator, host memory for the others.
template <class C>
struct memory_of {
  using type = host_memory;
};
template <class C>
requires requires { typename C::memory_space; }
struct memory_of<C> {
  using type = typename C::memory_space;
};

//! True when C can move buffers that live in Space: its own space, or any host-accessible space
//! for a communicator of host memory.
template <class C, class Space>
inline constexpr bool moves = std::is_same_v<typename memory_of<C>::type, Space> ||
                              (memory_of<C>::type::host_accessible && Space::host_accessible);

//! Compute -> communication: c's next operations see every result b has enqueued so far.
template <backend B, class C>
void handoff(const B& b, C& c) {
  if constexpr (requires { c.after(b); })
    c.after(b);
  else
    fence(b);
}

//! Communication -> compute: b's next work sees every operation c has enqueued so far.
template <backend B, class C>
void handback(const B& b, C& c) {
  if constexpr (requires { c.before(b); }) c.before(b);
}

//! Waits for requests from b's point of view: over a stream-ordered communicator b's stream waits
//! for them (no host block); over a host communicator the host waits (comm::wait_all).
template <backend B, class C>
void wait_all_on(const B& b, C& c, std::span<typename C::request> reqs) {
  if constexpr (requires(typename C::request & r) { c.wait(r, b); }) {
    for (auto& r : reqs) c.wait(r, b);
  } else {
    wait_all(c, reqs);
  }
}

//! An all_reduce of host memory, complete on return, on any communicator (the control plane:
//! decisions every rank must take alike, such as a convergence test).
template <class C, class T>
void host_all_reduce(C& c, std::span<const T> send, std::span<T> recv, reduce_op op) {
  if constexpr (requires { c.host_all_reduce(send, recv, op); })
    c.host_all_reduce(send, recv, op);
  else
    c.all_reduce(send, recv, op);
}

//! An all_gather of host memory, complete on return, on any communicator (the control plane).
template <class C, class T>
void host_all_gather(C& c, std::span<const T> send, std::span<T> recv) {
  if constexpr (requires { c.host_all_gather(send, recv); })
    c.host_all_gather(send, recv);
  else
    c.all_gather(send, recv);
}

}  // namespace loom::comm
