#pragma once

//! @file
//! Options shared by loom's scans, and the per-document states of linear recurrences.

#include <loom/core/tensor_view.hpp>

#include <cstddef>

namespace loom::scan {

//! Order in which a scan walks the sequence. reverse: out[i] combines x[i], x[i+1], ..., x[n-1]
//! (still in sequence order: x[i] op x[i+1] op ...).
enum class direction { forward, reverse };

//! Numbers of a scan, given to make_plan. The result depends on `block` (it fixes the combine
//! tree) and never on the thread count: for the same inputs and block, serial, openmp and kokkos
//! (and cuda with `reproducible`) give identical bits.
struct options {
  direction dir = direction::forward;  //!< monoid scans only; recurrences run forward, adjoints in reverse
  index_t block = 0;                   //!< elements per block; 0 picks one from n alone
  //! Monoid scans on loom::cuda: true runs loom's blocked engine (the same bits as every host
  //! backend, but one thread per block: slow on a GPU); false runs CUB's single-pass device scan,
  //! whose bits may vary from run to run for floating-point monoids. Integer plus, minimum and
  //! maximum always take CUB's scan (exact in any order). Host backends ignore it.
  bool reproducible = true;
};

//! The per-document states of a linear recurrence (documents from the plan's loom::segments).
//! Both parts are optional (an empty view):
//!   initial      [S, d]: h_{-1} of each document; empty: zeros
//!   final_state  [S, d]: receives each document's last state (an empty document's is its initial
//!                state); empty: not written
template <class T, class Space = host_memory>
struct states {
  tensor_view<const T, 2, Space> initial{};
  tensor_view<T, 2, Space> final_state{};
};

//! The per-document states of the adjoint recurrence:
//!   d_final    [S, d]: the gradient arriving at each document's final state; empty: zeros
//!   d_initial  [S, d]: receives the gradient of each document's initial state; empty: not written
template <class T, class Space = host_memory>
struct adjoint_states {
  tensor_view<const T, 2, Space> d_final{};
  tensor_view<T, 2, Space> d_initial{};
};

}  // namespace loom::scan
