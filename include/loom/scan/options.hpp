#pragma once

//! @file
//! Options shared by loom's scans.

#include <loom/core/tensor_view.hpp>

#include <cstddef>

namespace loom::scan {

//! Order in which a scan walks the sequence. reverse: out[i] combines x[i], x[i+1], ..., x[n-1]
//! (still in sequence order: x[i] op x[i+1] op ...).
enum class direction { forward, reverse };

//! Numbers of a scan. The result depends on `block` (it fixes the combine tree) and never on the
//! thread count: for the same inputs and block, serial, openmp and kokkos (and cuda with
//! `reproducible`) give identical bits.
struct options {
  direction dir = direction::forward;
  index_t block = 0;                //!< elements per block; 0 picks one from n alone
  void* workspace = nullptr;        //!< caller-owned scratch in the backend's memory space, or null
  std::size_t workspace_bytes = 0;  //!< its size; see the *_workspace_bytes functions
  //! Monoid scans on loom::cuda: true runs loom's blocked engine (the same bits as every host
  //! backend, but one thread per block: slow on a GPU); false runs CUB's single-pass device scan,
  //! whose bits may vary from run to run for floating-point monoids. Integer plus, minimum and
  //! maximum always take CUB's scan (exact in any order). Host backends ignore it.
  bool reproducible = true;
};

}  // namespace loom::scan
