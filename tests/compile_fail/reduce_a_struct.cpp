// expect: required for the satisfaction of .reducible<R>. \[with R = pair\]
// A struct can travel through a communicator as bytes, but it cannot be reduced.
#include <loom/comm/local.hpp>
struct pair {
  int a, b;
};
int main() {
  loom::comm::run_local(2, [](loom::comm::local& c) {
    pair x{1, 2};
    c.all_reduce(std::span<const pair>(&x, 1), std::span<pair>(&x, 1), loom::comm::reduce_op::sum);
  });
}
