// expect: loom::openmp needs OpenMP: link the loom::openmp CMake target
// Using the openmp policy in a translation unit built without OpenMP is a clear compile error,
// never a silent serial run.
#include <loom/backend/openmp.hpp>
#include <loom/backend/parallel.hpp>
int main() {
  loom::for_each_index(loom::openmp{}, 10, [](loom::index_t) {});
}
