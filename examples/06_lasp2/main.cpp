// LASP-2: gated linear attention over P ranks, checked against one device.
//   loom.example.lasp2 [ranks = 4]        in-process ranks (comm::local)
//   mpiexec -n 4 loom.example.lasp2_mpi   the same code over MPI (comm::mpi)

#include <loom/backend/serial.hpp>
#include <loom/linear_attention/chunked.hpp>
#include <loom/linear_attention/lasp2.hpp>

#if defined(LOOM_EXAMPLE_MPI)
#include <loom/comm/mpi.hpp>
#else
#include <loom/comm/local.hpp>
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <vector>

namespace la = loom::linear_attention;
using loom::index_t;

int main(int argc, char** argv) {
  const index_t T = 1000, H = 2, d = 16;
  const std::vector<std::int32_t> cu{0, 300, 301, 1000};  // three documents (int32 offsets); the last crosses ranks
  const loom::segments<> docs{std::span<const std::int32_t>(cu)};
  std::mt19937 g(1);
  std::uniform_real_distribution<float> u(-1, 1), gate(-0.2f, 0.0f);
  std::vector<float> q(T * H * d), k(q.size()), v(q.size()), lg(T * H), o1(q.size()), op(q.size());
  for (auto* x : {&q, &k, &v})
    for (auto& y : *x) y = u(g);
  for (auto& y : lg) y = gate(g);
  // One device.
  using cv3 = loom::tensor_view<const float, 3>;
  const la::operands all{cv3(q.data(), {T, H, d}), cv3(k.data(), {T, H, d}), cv3(v.data(), {T, H, d})};  // fp32
  const la::scalar_gate<float> gates{loom::tensor_view<const float, 2>(lg.data(), {T, H})};
  la::forward(loom::serial{}, docs, gates, all, loom::tensor_view<float, 3>(o1.data(), {T, H, d}));
  // P ranks, each with a contiguous slice: plan once (the cross-rank agreement runs here), then
  // call the plan form with a workspace as often as needed (layer after layer; no allocation).
  auto rank_part = [&](auto& comm, int ranks) {
    const index_t b = T * comm.rank() / ranks, e = T * (comm.rank() + 1) / ranks, n = e - b;
    const la::operands mine{cv3(q.data() + b * H * d, {n, H, d}), cv3(k.data() + b * H * d, {n, H, d}),
                            cv3(v.data() + b * H * d, {n, H, d})};
    const la::scalar_gate<float> my_gates{loom::tensor_view<const float, 2>(lg.data() + b * H, {n, H})};
    const auto plan = la::lasp2::make_plan(loom::serial{}, comm, docs, b, {.tokens = n, .heads = H, .dk = d, .dv = d});
    loom::workspace_buffer ws(plan.forward_workspace_bytes());
    la::lasp2::forward(loom::serial{}, comm, plan, my_gates, mine,
                       loom::tensor_view<float, 3>(op.data() + b * H * d, {n, H, d}), {}, {}, ws.span());
  };
#if defined(LOOM_EXAMPLE_MPI)
  MPI_Init(&argc, &argv);
  int P = 0, me = 0;
  {
    loom::comm::mpi comm(MPI_COMM_WORLD);
    P = comm.size();
    me = comm.rank();
    rank_part(comm, P);
    // each rank wrote its own rows (zeros elsewhere): the sum over ranks is the whole output
    comm.all_reduce(std::span<const float>(op), std::span<float>(op), loom::comm::reduce_op::sum);
  }
  MPI_Finalize();
#else
  const int P = argc > 1 ? std::atoi(argv[1]) : 4, me = 0;
  if (P < 1) {
    std::fprintf(stderr, "usage: %s [ranks >= 1]\n", argv[0]);
    return 2;
  }
  loom::comm::run_local(P, [&](loom::comm::local& comm) { rank_part(comm, P); });
#endif
  double worst = 0;
  for (std::size_t i = 0; i < o1.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(o1[i] - op[i])));
  if (me == 0)
    std::printf("LASP-2 over %d ranks vs one device: max |difference| = %.3g (%s)\n", P, worst,
                worst < 1e-4 ? "ok" : "MISMATCH");
  return worst < 1e-4 ? 0 : 1;
}
