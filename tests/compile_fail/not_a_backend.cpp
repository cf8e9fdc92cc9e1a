// expect: required for the satisfaction of .backend<B>. \[with B = int\]
// A type without backend_traits is not a backend: the concept rejects it at the call.
#include <loom/backend/parallel.hpp>
int main() {
  loom::for_each_index(42, 10, [](loom::index_t) {});
}
