// expect: required for the satisfaction of .floating_storage<Storage>. \[with Storage = int\]
// precision<Storage, Accum> accepts floating storage types only.
#include <loom/core/precision.hpp>
int main() {
  loom::precision<int, float> p;
  (void)p;
}
