// A downstream program: includes loom's public headers and uses the core, an openmp backend loop,
// the in-process communicator and (linked, initialised) the MPI communicator.
#include <loom/backend/openmp.hpp>
#include <loom/backend/parallel.hpp>
#include <loom/comm/local.hpp>
#include <loom/comm/mpi.hpp>
#include <loom/loom.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int status = 0;
  {
    loom::comm::mpi world;
    const double s = loom::reduce(
        loom::openmp{.threads = 2}, 1000, 0.0, [](double a, double b) { return a + b; },
        [](loom::index_t i) { return static_cast<double>(i); });
    const auto sums = loom::comm::run_local(3, [](loom::comm::local& c) {
      int v = c.rank() + 1, total = 0;
      c.all_reduce(std::span<const int>(&v, 1), std::span<int>(&total, 1), loom::comm::reduce_op::sum);
      return total;
    });
    status = (s == 499500.0 && sums[0] == 6 && sums[2] == 6 && world.size() >= 1) ? 0 : 1;
    std::printf("loom %d.%d.%d consumer: reduce %g, local all_reduce %d, mpi ranks %d: %s\n", loom::version.major,
                loom::version.minor, loom::version.patch, s, sums[0], world.size(), status ? "FAILED" : "OK");
  }
  MPI_Finalize();
  return status;
}
