#pragma once

// The sgemm baselines: every BLAS a user could install on this machine (Debian's OpenBLAS, a
// current OpenBLAS from the Python registry's scipy-openblas32, MKL from the Python registry,
// Debian's BLIS), each loaded at run time with dlopen (RTLD_LOCAL | RTLD_DEEPBIND, so each one
// runs its own kernels even where the symbol names collide). CMake lists the libraries it found
// in loom_bench_sgemm_libraries.hpp; LOOM_BENCH_SGEMM=<kind>:<path>[,<kind>:<path>...] replaces
// that list (kinds: openblas, scipy_openblas, mkl, blis). A benchmark reads its sgemm row against
// fastest(m, n, k, threads): every loaded library timed on that shape, the fastest kept.

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <dlfcn.h>
#include <loom_bench_sgemm_libraries.hpp>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace loom::bench {

//! One BLAS: its cblas_sgemm, its thread setter and what it says of itself.
struct sgemm_library {
  using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                            int);
  std::string kind, path, name;  //!< name: "OpenBLAS 0.3.21 Haswell", "MKL 2025.3", ...
  sgemm_fn sgemm = nullptr;
  void (*set_openblas_threads)(int) = nullptr;
  void (*set_mkl_threads)(int) = nullptr;
  void (*set_blis_threads)(long) = nullptr;

  void threads(int t) const {
    if (set_openblas_threads) set_openblas_threads(t);
    if (set_mkl_threads) set_mkl_threads(t);
    if (set_blis_threads) set_blis_threads(t);
  }
  //! Row-major C (m x n) = alpha A (m x k) times B (k x n, or n x k when trans_b).
  void run(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc,
           bool trans_b = false, float alpha = 1.0f) const {
    constexpr int row_major = 101, no_trans = 111, trans = 112;
    sgemm(row_major, no_trans, trans_b ? trans : no_trans, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
  }
};

namespace detail {

template <class F>
F symbol(void* h, const char* name) {
  return reinterpret_cast<F>(dlsym(h, name));
}

inline bool load(sgemm_library& lib) {
  void* h = dlopen(lib.path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (!h) return false;
  using config_fn = char* (*)();
  if (lib.kind == "openblas" || lib.kind == "scipy_openblas") {
    const std::string p = lib.kind == "openblas" ? "" : "scipy_";
    lib.sgemm = symbol<sgemm_library::sgemm_fn>(h, (p + "cblas_sgemm").c_str());
    lib.set_openblas_threads = symbol<void (*)(int)>(h, (p + "openblas_set_num_threads").c_str());
    const auto config = symbol<config_fn>(h, (p + "openblas_get_config").c_str());
    const auto core = symbol<config_fn>(h, (p + "openblas_get_corename").c_str());
    std::string c = config ? config() : "OpenBLAS";
    c = c.substr(0, c.find(" NO_"));
    lib.name = c + (core ? std::string(", ") + core() + " kernels" : "") +
               (lib.kind == "openblas" ? " (Debian)" : " (scipy-openblas32)");
  } else if (lib.kind == "mkl") {
    // The GNU threading layer: MKL on libgomp's threads, like the OpenMP code beside it.
    if (const auto layer = symbol<int (*)(int)>(h, "MKL_Set_Threading_Layer")) layer(3);  // MKL_THREADING_GNU
    lib.sgemm = symbol<sgemm_library::sgemm_fn>(h, "cblas_sgemm");
    lib.set_mkl_threads = symbol<void (*)(int)>(h, "MKL_Set_Num_Threads");
    char version[256] = "MKL";
    if (const auto v = symbol<void (*)(char*, int)>(h, "MKL_Get_Version_String")) v(version, sizeof version);
    lib.name = version;
  } else if (lib.kind == "blis") {
    lib.sgemm = symbol<sgemm_library::sgemm_fn>(h, "cblas_sgemm");
    lib.set_blis_threads = symbol<void (*)(long)>(h, "bli_thread_set_num_threads");
    const auto v = symbol<const char* (*)()>(h, "bli_info_get_version_str");
    const auto arch = symbol<const char* (*)(int)>(h, "bli_arch_string");
    const auto id = symbol<int (*)()>(h, "bli_arch_query_id");
    lib.name = std::string("BLIS ") + (v ? v() : "") + (arch && id ? std::string(", ") + arch(id()) + " kernels" : "");
  }
  return lib.sgemm != nullptr;
}

}  // namespace detail

//! The libraries that loaded, in the configured order.
inline const std::vector<sgemm_library>& sgemm_libraries() {
  static const std::vector<sgemm_library> libs = [] {
    std::vector<std::pair<std::string, std::string>> wanted;
    if (const char* env = std::getenv("LOOM_BENCH_SGEMM")) {
      std::string s = env;
      for (std::size_t at = 0; at <= s.size();) {
        const std::size_t end = std::min(s.find(',', at), s.size()), colon = s.find(':', at);
        if (colon < end) wanted.emplace_back(s.substr(at, colon - at), s.substr(colon + 1, end - colon - 1));
        at = end + 1;
      }
    } else {
      for (const auto& [kind, path] : configured_sgemm_libraries) wanted.emplace_back(kind, path);
    }
    std::vector<sgemm_library> out;
    for (const auto& [kind, path] : wanted) {
      sgemm_library lib;
      lib.kind = kind;
      lib.path = path;
      if (detail::load(lib)) out.push_back(lib);
    }
    return out;
  }();
  return libs;
}

//! The fastest loaded library for one shape and thread count (each timed on it, best of three
//! runs after a warm-up; chosen once per shape). Null when none loaded.
inline const sgemm_library* fastest(int m, int n, int k, int threads) {
  static std::map<std::tuple<int, int, int, int>, const sgemm_library*> chosen;
  const auto key = std::make_tuple(m, n, k, threads);
  if (const auto it = chosen.find(key); it != chosen.end()) return it->second;
  const auto& libs = sgemm_libraries();
  const sgemm_library* best = nullptr;
  if (libs.size() == 1) best = &libs[0];
  if (libs.size() > 1) {
    std::vector<float> a(static_cast<std::size_t>(m) * k, 1.0f), b(static_cast<std::size_t>(k) * n, 0.5f),
        c(static_cast<std::size_t>(m) * n);
    double best_time = 0;
    for (const auto& lib : libs) {
      lib.threads(threads);
      lib.run(m, n, k, a.data(), k, b.data(), n, c.data(), n);
      double t = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        lib.run(m, n, k, a.data(), k, b.data(), n, c.data(), n);
        t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      lib.threads(1);  // idle pools must not compete with later rows
      if (!best || t < best_time) {
        best = &lib;
        best_time = t;
      }
    }
  }
  chosen[key] = best;
  return best;
}

}  // namespace loom::bench
