// The main of every loom.bench.* executable. It records what a number depends on (revision,
// compiler, build, machine) in the benchmark context, so a JSON result stands on its own and
// bench/report can print it next to the figures.

#include <loom/version.hpp>

#include <benchmark/benchmark.h>

#include <fstream>
#include <string>
#include <thread>

#if defined(_OPENMP)
#include <omp.h>
#endif

#ifndef LOOM_GIT_REVISION
#define LOOM_GIT_REVISION "unknown"
#endif
#ifndef LOOM_BENCH_BUILD_TYPE
#define LOOM_BENCH_BUILD_TYPE "unknown"
#endif
#ifndef LOOM_BENCH_CXX_FLAGS
#define LOOM_BENCH_CXX_FLAGS ""
#endif

namespace {

// The kernel's name for the CPU; Google Benchmark's own context has only caches and MHz.
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) break;
    const auto start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? std::string() : line.substr(start);
  }
  return "unknown";
}

std::string compiler() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "g++ " __VERSION__;
#else
  return "unknown";
#endif
}

std::string loom_version() {
  return std::to_string(loom::version.major) + "." + std::to_string(loom::version.minor) + "." +
         std::to_string(loom::version.patch);
}

int openmp_max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 0;  // built without OpenMP
#endif
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("loom_git_revision", LOOM_GIT_REVISION);
  benchmark::AddCustomContext("loom_version", loom_version());
  benchmark::AddCustomContext("loom_compiler", compiler());
  benchmark::AddCustomContext("loom_build_type", LOOM_BENCH_BUILD_TYPE);
  benchmark::AddCustomContext("loom_cxx_flags", LOOM_BENCH_CXX_FLAGS);
  benchmark::AddCustomContext("loom_cpu_model", cpu_model());
  benchmark::AddCustomContext("loom_logical_cores", std::to_string(std::thread::hardware_concurrency()));
  benchmark::AddCustomContext("loom_openmp_max_threads", std::to_string(openmp_max_threads()));

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
