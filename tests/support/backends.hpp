#pragma once

// The backend under test, chosen by the LOOM_TEST_BACKEND_<B> macro a generated translation unit
// defines (see loom_add_backend_test in cmake/LoomTesting.cmake). A body uses:
//   loom::test::backend_under_test        the policy type
//   loom::test::make_backend()            an instance (openmp: 2 threads, the CI machine's cores)
//   loom::test::buffer<T>                 storage in the backend's memory space, with to_host()
//   loom::test::workspace                 a plan's workspace in that space (aligned, or shifted)
//   LOOM_BACKEND_TAG                      "[serial]", "[openmp]", ...

#include <loom/backend/parallel.hpp>
#include <loom/backend/serial.hpp>
#include <loom/core/workspace.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#if defined(LOOM_TEST_BACKEND_SERIAL)
namespace loom::test {
using backend_under_test = loom::serial;
inline backend_under_test make_backend() { return {}; }
}  // namespace loom::test
#define LOOM_BACKEND_TAG "[serial]"
#elif defined(LOOM_TEST_BACKEND_OPENMP)
#include <loom/backend/openmp.hpp>
namespace loom::test {
using backend_under_test = loom::openmp;
inline backend_under_test make_backend() { return {.threads = 2}; }
}  // namespace loom::test
#define LOOM_BACKEND_TAG "[openmp]"
#elif defined(LOOM_TEST_BACKEND_KOKKOS)
#include <loom/backend/kokkos.hpp>
namespace loom::test {
using backend_under_test = loom::kokkos<>;
inline backend_under_test make_backend() { return {}; }
}  // namespace loom::test
#define LOOM_BACKEND_TAG "[kokkos]"
#elif defined(LOOM_TEST_BACKEND_CUDA)
#include <loom/backend/cuda.hpp>
namespace loom::test {
using backend_under_test = loom::cuda;
inline backend_under_test make_backend() { return {}; }
}  // namespace loom::test
#define LOOM_BACKEND_TAG "[cuda]"
#elif defined(LOOM_TEST_BACKEND_STANDIN)
#include <loom/backend/standin.hpp>

#include <cstdlib>
namespace loom::test {
using backend_under_test = loom::standin;
//! One stream per test process, with random delays of up to LOOM_STANDIN_MAX_DELAY_US
//! microseconds per operation (default 20) and the seed LOOM_STANDIN_SEED (default 1).
inline loom::standin_stream& standin_test_stream() {
  static loom::standin_stream s([] {
    const char* d = std::getenv("LOOM_STANDIN_MAX_DELAY_US");
    const char* seed = std::getenv("LOOM_STANDIN_SEED");
    return loom::standin_delays{.seed = seed != nullptr ? std::strtoull(seed, nullptr, 10) : 1u,
                                .max_delay = std::chrono::microseconds(d != nullptr ? std::atoll(d) : 20)};
  }());
  return s;
}
inline backend_under_test make_backend() { return {&standin_test_stream()}; }
}  // namespace loom::test
#define LOOM_BACKEND_TAG "[standin]"
#else
#error "define one LOOM_TEST_BACKEND_<B> before including support/backends.hpp"
#endif

namespace loom::test {

//! The memory space of the backend under test.
using space = typename backend_traits<backend_under_test>::memory_space;

//! n elements in the memory space of the backend under test, initialised from `init`.
template <class T>
class buffer {
 public:
  explicit buffer(const std::vector<T>& init) : n_(init.size()) {
#if defined(LOOM_TEST_BACKEND_CUDA)
    LOOM_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&ptr_), sizeof(T) * n_ + 1));
    LOOM_CUDA_TRY(cudaMemcpy(ptr_, init.data(), sizeof(T) * n_, cudaMemcpyHostToDevice));
#else
    host_ = init;
    ptr_ = host_.data();
#endif
  }
  explicit buffer(std::size_t n) : buffer(std::vector<T>(n)) {}
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  ~buffer() {
#if defined(LOOM_TEST_BACKEND_CUDA)
    cudaFree(ptr_);
#elif defined(LOOM_TEST_BACKEND_STANDIN)
    try {  // cudaFree waits for the device likewise
      standin_test_stream().synchronize();
    } catch (...) {
    }
#endif
  }
  T* data() const { return ptr_; }
  std::size_t size() const { return n_; }
  //! A host copy, after the backend has finished.
  std::vector<T> to_host() const {
    fence(make_backend());
#if defined(LOOM_TEST_BACKEND_CUDA)
    std::vector<T> h(n_);
    LOOM_CUDA_TRY(cudaMemcpy(h.data(), ptr_, sizeof(T) * n_, cudaMemcpyDeviceToHost));
    return h;
#else
    return host_;
#endif
  }

 private:
  std::size_t n_;
  T* ptr_ = nullptr;
  std::vector<T> host_;
};

//! A row-major view of a buffer with the given extents (T may be const).
template <class T, std::size_t R>
tensor_view<T, R, space> view_of(const buffer<std::remove_const_t<T>>& b, const std::array<index_t, R>& ext) {
  return tensor_view<T, R, space>(b.data(), ext);
}

//! A workspace in the backend's memory space: span(shift) is `bytes` bytes starting `shift` bytes
//! after a loom::workspace_alignment boundary (shift > 0 tests the alignment check).
class workspace {
 public:
  explicit workspace(std::size_t bytes) : bytes_(bytes), buf_(bytes + 2 * loom::workspace_alignment) {}
  std::span<std::byte> span(std::size_t shift = 0) const {
    const auto p = reinterpret_cast<std::uintptr_t>(buf_.data());
    const auto pad = (loom::workspace_alignment - p % loom::workspace_alignment) % loom::workspace_alignment;
    return {buf_.data() + pad + shift, bytes_};
  }

 private:
  std::size_t bytes_;
  buffer<std::byte> buf_;
};

}  // namespace loom::test
