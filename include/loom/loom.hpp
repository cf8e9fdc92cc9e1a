#pragma once

//! @file
//! The umbrella header: everything that compiles with any C++20 host compiler and needs no
//! dependency beyond the standard library. Backends and communicators with a dependency
//! (openmp, kokkos, cuda, mpi, nccl) have their own headers: include those explicitly.

#include <loom/backend/openmp.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/backend/serial.hpp>
#include <loom/comm/any.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/local.hpp>
#include <loom/config.hpp>
#include <loom/core/concepts.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/core/memory_space.hpp>
#include <loom/core/precision.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/version.hpp>
