// The packing planners of include/loom/packing/: how evenly they balance the modelled cost of
// micro-batches on long-tail document lengths, and how fast they plan.
//
// packing.balance/dist:D/N:n/wlb:C  A stream of `steps` global batches, each of about n * W
//     tokens (W = 32768, the context window) drawn from distribution D, packed three ways:
//     first_fit_decreasing and best_fit_decreasing on capacity W (as many micro-batches as they
//     need), and one wlb_packer with n micro-batches of at most 2 W tokens, fed the batches as
//     its steps (configuration C). Counters, over the steps: the mean and the worst per-step
//     max / mean modelled cost of each packer, the mean micro-batch count of FFD and BFD, and two
//     bounds: `bound`, the best max / mean any packing of a step's fresh documents into n
//     micro-batches can reach (max(largest document, total / n) / (total / n)), and `wlb_bound`,
//     the same for the documents WLB emitted in that step (after its delays). The time of these
//     rows is not a figure.
// packing.profile/...  The same stream for one configuration; writes the per-micro-batch costs of
//     its median and its worst step (by WLB max / mean, after the first max_delay_steps) to
//     $LOOM_BENCH_DATA_DIR/packing-profile.csv for the plot of bench/report.
// packing.ffd, packing.bfd  Planning 1M documents: docs/s.
// packing.wlb/dist:D/N:n  wlb_packer::push on a stream of n * W-token batches: docs/s.
// packing.shard.per_document/P:p  shard::make_plan of one packed micro-batch: tokens/s, and the
//     max / mean causal pairs per rank of the plan and of shard::zigzag on the same input.

#include <loom/core/error.hpp>
#include <loom/packing/cost_model.hpp>
#include <loom/packing/packer.hpp>
#include <loom/packing/wlb.hpp>
#include <loom/shard/plan.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace {

using loom::index_t;
namespace pk = loom::packing;

constexpr index_t window = 32768;  // W: the context window, and the FFD / BFD capacity
constexpr int steps = 20;          // global batches per balance row

// Modelled cost in units of one causal (query, key) pair of attention. Per token, the dense
// layers of a transformer do about 24 d^2 FLOPs (QKV and output projections 8 d^2, a 4d-wide MLP
// 16 d^2) and attention about 4 d per pair (QK^T and PV), so beta = 24 d^2 / 4 d = 6 d; d = 4096,
// a 7B-class model. A W-token document then spends 40% of its work in attention.
constexpr double d_model = 4096;
const pk::cost_model model{1.0, 6 * d_model, 0.0};

enum class tail { lognormal, pareto };

const char* name_of(tail t) { return t == tail::lognormal ? "lognormal" : "pareto"; }

// Document lengths clipped to [1, W]: lognormal with median 2048 and sigma 1, or Pareto with
// x_min 256 and alpha 1.2. Both put a point mass at W, the rare documents as long as the window.
class length_source {
 public:
  length_source(tail t, std::uint64_t seed) : tail_(t), gen_(seed) {}
  index_t next() {
    const double x = tail_ == tail::lognormal ? lognormal_(gen_) : 256.0 / std::pow(1.0 - uniform_(gen_), 1.0 / 1.2);
    return std::clamp<index_t>(static_cast<index_t>(std::llround(std::min(x, 1e12))), 1, window);
  }
  // Documents drawn until the next one would take the batch over `tokens`.
  std::vector<index_t> batch(index_t tokens) {
    std::vector<index_t> out;
    for (index_t total = 0;;) {
      const index_t l = next();
      if (total + l > tokens) return out;
      out.push_back(l);
      total += l;
    }
  }

 private:
  tail tail_;
  std::mt19937_64 gen_;
  std::lognormal_distribution<double> lognormal_{std::log(2048.0), 1.0};
  std::uniform_real_distribution<double> uniform_{0.0, 1.0};
};

std::uint64_t seed_of(tail t, int n) {
  return 0x5eed0000u + 1000u * static_cast<unsigned>(t) + static_cast<unsigned>(n);
}

// A level of the delay queue only groups its documents if N of them arrive within the delay
// bound (max_delay_steps + 1 steps); otherwise they leave as due documents, fewer than N at a
// time, and unbalance the step that emits them. Documents >= 8192 arrive at about 0.5 N (Pareto)
// to 0.8 N (lognormal) per step, so "base" has that one level. "two_levels" adds a level at
// 16384, whose documents arrive at about 0.2 N per step, 0.6 N within the bound: the failure
// case. "delay_4" widens the bound; "batch_1.5x" feeds 1.5 N W tokens per step, so micro-batches
// average 1.5 W tokens (within the 2 W cap) instead of W.
struct wlb_config {
  const char* name;
  std::vector<index_t> thresholds;
  int max_delay_steps;
  double batch_scale;
};

const std::vector<wlb_config>& configs() {
  static const std::vector<wlb_config> c = {
      {"base", {8192}, 2, 1.0},
      {"two_levels", {8192, 16384}, 2, 1.0},
      {"delay_4", {8192}, 4, 1.0},
      {"batch_1.5x", {8192}, 2, 1.5},
  };
  return c;
}

// One step of the stream: the modelled cost of every micro-batch of each packer, and the bounds.
struct step_record {
  std::vector<double> ffd, bfd, wlb;
  std::vector<index_t> ffd_tokens, wlb_tokens;
  double bound = 1, wlb_bound = 1;
};

// max(largest document, total / n) / (total / n): no assignment to n micro-batches does better.
double bound_of(std::span<const double> document_costs, int n) {
  double total = 0, largest = 0;
  for (double c : document_costs) {
    total += c;
    largest = std::max(largest, c);
  }
  const double mean = total / n;
  return mean > 0 ? std::max(largest, mean) / mean : 1.0;
}

struct stream_result {
  std::vector<step_record> steps;
  double documents_per_step = 0;
  std::size_t pending = 0;  // documents still queued or carried after the last step
};

stream_result run_stream(tail t, int n, const wlb_config& c) {
  length_source source(t, seed_of(t, n));
  pk::wlb_options o;
  o.micro_batches = n;
  o.token_cap = 2 * window;
  o.outlier_thresholds = c.thresholds;
  o.max_delay_steps = c.max_delay_steps;
  o.cost = model;
  pk::wlb_packer packer(o);
  const pk::bin_options bins{window, pk::oversize::reject, 0};
  const auto tokens = static_cast<index_t>(c.batch_scale * static_cast<double>(n * window));

  stream_result out;
  index_t next_id = 0;
  std::vector<pk::document> docs;
  std::vector<double> costs;
  for (int s = 0; s < steps; ++s) {
    const auto lengths = source.batch(tokens);
    out.documents_per_step += static_cast<double>(lengths.size()) / steps;
    step_record r;
    costs.clear();
    docs.clear();
    for (index_t l : lengths) {
      costs.push_back(model(l));
      docs.push_back({next_id++, l});
    }
    r.bound = bound_of(costs, n);
    for (const auto& b : pk::first_fit_decreasing(lengths, bins)) {
      r.ffd.push_back(b.cost(model));
      r.ffd_tokens.push_back(b.tokens());
    }
    for (const auto& b : pk::best_fit_decreasing(lengths, bins)) r.bfd.push_back(b.cost(model));
    const auto step = packer.push(docs);
    costs.clear();
    for (const auto& b : step.micro_batches) {
      r.wlb.push_back(b.cost(model));
      r.wlb_tokens.push_back(b.tokens());
      for (std::size_t i = 0; i + 1 < b.cu_seqlens.size(); ++i)
        costs.push_back(model(b.cu_seqlens[i + 1] - b.cu_seqlens[i]));
    }
    r.wlb_bound = bound_of(costs, n);
    out.steps.push_back(std::move(r));
  }
  out.pending = packer.pending();
  return out;
}

double ratio(const std::vector<double>& costs) { return pk::balance_of(costs).max_over_mean; }

// Mean and worst of a per-step figure.
template <class F>
std::pair<double, double> mean_worst(const stream_result& r, F figure) {
  double sum = 0, worst = 0;
  for (const auto& s : r.steps) {
    const double v = figure(s);
    sum += v;
    worst = std::max(worst, v);
  }
  return {sum / static_cast<double>(r.steps.size()), worst};
}

void balance(benchmark::State& state, tail t, int n, const wlb_config& c) {
  stream_result r;
  try {
    for (auto _ : state) {
      r = run_stream(t, n, c);
      benchmark::DoNotOptimize(r.steps.data());
    }
  } catch (const loom::error& e) {
    state.SkipWithError(e.what());
    return;
  }
  // "<what>_max_over_mean": the mean over the steps; "<what>_worst": the worst step.
  auto put = [&](const std::string& what, auto figure) {
    const auto [mean, worst] = mean_worst(r, figure);
    state.counters[what + "_max_over_mean"] = mean;
    state.counters[what + "_worst"] = worst;
  };
  put("ffd", [](const step_record& s) { return ratio(s.ffd); });
  put("bfd", [](const step_record& s) { return ratio(s.bfd); });
  put("wlb", [](const step_record& s) { return ratio(s.wlb); });
  state.counters["ffd_micro_batches"] =
      mean_worst(r, [](const step_record& s) { return static_cast<double>(s.ffd.size()); }).first;
  state.counters["bfd_micro_batches"] =
      mean_worst(r, [](const step_record& s) { return static_cast<double>(s.bfd.size()); }).first;
  put("bound", [](const step_record& s) { return s.bound; });
  put("wlb_bound", [](const step_record& s) { return s.wlb_bound; });
  state.counters["docs_per_step"] = r.documents_per_step;
  state.counters["pending"] = static_cast<double>(r.pending);
}

// Writes the median step (by WLB max / mean) of one stream for bench/report's plot.
void profile(benchmark::State& state, tail t, int n, const wlb_config& c) {
  stream_result r;
  for (auto _ : state) r = run_stream(t, n, c);
  // The first max_delay_steps steps emit no delayed documents yet: leave them out.
  std::vector<std::pair<double, std::size_t>> by_ratio;
  for (auto i = static_cast<std::size_t>(c.max_delay_steps); i < r.steps.size(); ++i)
    by_ratio.push_back({ratio(r.steps[i].wlb), i});
  std::sort(by_ratio.begin(), by_ratio.end());
  const std::size_t median = by_ratio[by_ratio.size() / 2].second, worst = by_ratio.back().second;
  state.counters["median_step"] = static_cast<double>(median);
  state.counters["worst_step"] = static_cast<double>(worst);
  const char* dir = std::getenv("LOOM_BENCH_DATA_DIR");
  if (dir == nullptr || *dir == '\0') return;  // run by hand: nothing to plot
  const std::string path = std::string(dir) + "/packing-profile.csv";
  std::ofstream csv(path);
  csv << "distribution,N,which,step,packer,micro_batch,tokens,cost\n";
  for (const auto& [which, step] : {std::pair{"median", median}, std::pair{"worst", worst}}) {
    const auto& s = r.steps[step];
    auto rows = [&](const char* packer, const std::vector<double>& cost, const std::vector<index_t>& tokens) {
      for (std::size_t i = 0; i < cost.size(); ++i)
        csv << name_of(t) << ',' << n << ',' << which << ',' << step << ',' << packer << ',' << i << ',' << tokens[i]
            << ',' << cost[i] << '\n';
    };
    rows("ffd", s.ffd, s.ffd_tokens);
    rows("wlb", s.wlb, s.wlb_tokens);
  }
  if (!csv) state.SkipWithError(("cannot write " + path).c_str());
}

// ---------------------------------------------------------------------------------------------
// Planner speed

const std::vector<index_t>& million_lengths() {
  static const std::vector<index_t> v = [] {
    length_source source(tail::lognormal, 42);
    std::vector<index_t> out(1'000'000);
    for (auto& l : out) l = source.next();
    return out;
  }();
  return v;
}

template <auto Packer>
void bin_speed(benchmark::State& state) {
  const auto& lengths = million_lengths();
  const pk::bin_options o{window, pk::oversize::reject, 0};
  std::size_t bins = 0;
  for (auto _ : state) {
    auto plan = Packer(lengths, o);
    bins = plan.size();
    benchmark::DoNotOptimize(plan.data());
  }
  state.counters["docs/s"] =
      benchmark::Counter(static_cast<double>(lengths.size()), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["micro_batches"] = static_cast<double>(bins);
}

void wlb_speed(benchmark::State& state, tail t) {
  const int n = static_cast<int>(state.range(0));
  const auto& c = configs()[0];
  length_source source(t, seed_of(t, n) + 1);
  std::vector<std::vector<pk::document>> batches(steps);
  index_t id = 0;
  for (auto& b : batches)
    for (index_t l : source.batch(n * window)) b.push_back({id++, l});
  pk::wlb_options o;
  o.micro_batches = n;
  o.token_cap = 2 * window;
  o.outlier_thresholds = c.thresholds;
  o.max_delay_steps = c.max_delay_steps;
  o.cost = model;
  pk::wlb_packer packer(o);
  // The packer keeps its queues from one iteration to the next: a stream, as in training.
  double docs = 0;
  std::size_t k = 0;
  for (auto _ : state) {
    const auto& b = batches[k++ % batches.size()];
    auto step = packer.push(b);
    benchmark::DoNotOptimize(step.micro_batches.data());
    docs += static_cast<double>(b.size());
  }
  state.counters["docs/s"] = benchmark::Counter(docs, benchmark::Counter::kIsRate);
  state.counters["docs_per_step"] = docs / static_cast<double>(state.iterations());
}

double pair_balance(const loom::shard::plan& p) {
  std::vector<double> pairs;
  for (int r = 0; r < p.ranks(); ++r) pairs.push_back(static_cast<double>(p.rank(r).causal_pairs));
  return pk::balance_of(pairs).max_over_mean;
}

void shard_speed(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  // The fullest micro-batch of one WLB step on lognormal lengths: a packed sequence of up to 2 W.
  length_source source(tail::lognormal, 7);
  std::vector<pk::document> docs;
  index_t id = 0;
  for (index_t l : source.batch(16 * window)) docs.push_back({id++, l});
  pk::wlb_options o;
  o.micro_batches = 16;
  o.token_cap = 2 * window;
  o.cost = model;
  const auto step = pk::wlb_packer(o).push(docs);
  const auto& mb = *std::max_element(step.micro_batches.begin(), step.micro_batches.end(),
                                     [](const auto& a, const auto& b) { return a.tokens() < b.tokens(); });
  double balance = 1;
  for (auto _ : state) {
    auto plan = loom::shard::make_plan(loom::segments(std::span<const loom::index_t>(mb.cu_seqlens)), ranks,
                                       loom::shard::per_document{});
    balance = pair_balance(plan);
    benchmark::DoNotOptimize(&plan);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(mb.tokens()), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens"] = static_cast<double>(mb.tokens());
  state.counters["documents"] = static_cast<double>(mb.documents.size());
  state.counters["pair_max_over_mean"] = balance;
  state.counters["zigzag_pair_max_over_mean"] = pair_balance(loom::shard::make_plan(
      loom::segments(std::span<const loom::index_t>(mb.cu_seqlens)), ranks, loom::shard::zigzag{}));
}

[[maybe_unused]] const bool registered = [] {
  for (tail t : {tail::lognormal, tail::pareto})
    for (int n : {8, 16, 32})
      for (const auto& c : configs()) {
        const std::string name =
            std::string("packing.balance/dist:") + name_of(t) + "/N:" + std::to_string(n) + "/wlb:" + c.name;
        benchmark::RegisterBenchmark(name.c_str(), [t, n, &c](benchmark::State& s) { balance(s, t, n, c); })
            ->Iterations(1)
            ->Unit(benchmark::kMillisecond);
      }
  benchmark::RegisterBenchmark("packing.profile/dist:lognormal/N:16/wlb:base",
                               [](benchmark::State& s) { profile(s, tail::lognormal, 16, configs()[0]); })
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond);
  for (tail t : {tail::lognormal, tail::pareto})
    benchmark::RegisterBenchmark((std::string("packing.wlb/dist:") + name_of(t)).c_str(),
                                 [t](benchmark::State& s) { wlb_speed(s, t); })
        ->ArgName("N")
        ->Arg(8)
        ->Arg(32)
        ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace

BENCHMARK(bin_speed<pk::first_fit_decreasing>)->Name("packing.ffd/docs:1000000")->Unit(benchmark::kMillisecond);
BENCHMARK(bin_speed<pk::best_fit_decreasing>)->Name("packing.bfd/docs:1000000")->Unit(benchmark::kMillisecond);
BENCHMARK(shard_speed)->Name("packing.shard.per_document")->ArgName("P")->Arg(4)->Arg(8)->Unit(benchmark::kMicrosecond);
