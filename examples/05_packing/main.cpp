// loom packing: document lengths from a file are packed into micro-batches with first-fit-
// decreasing, best-fit-decreasing and the workload-balanced packer (WLB), and the balance of the
// modelled cost is compared; then the first WLB micro-batch is sharded over P = 4 context-
// parallel ranks with shard::per_document and compared with zigzag and contiguous.
//
//   loom.example.packing [lengths.txt] [window = 32768] [micro_batches = 8]
//
// lengths.txt (default: examples/05_packing/lengths.txt, relative to the working directory) holds
// one document length in tokens per line, a positive integer no longer than the window; blank
// lines and lines starting with '#' are skipped. Any other line is an error: exit code 2.
//
// The documents are read as a data loader's stream and cut, in order, into steps (global batches)
// of at most micro_batches * window tokens. FFD and BFD pack each step on capacity = window, into
// as many micro-batches as they need; WLB gets the steps one by one with micro_batches
// micro-batches of up to 2 * window tokens, may hold long documents back for up to 2 steps, and
// is flushed at the end.

#include <loom/packing/cost_model.hpp>
#include <loom/packing/packer.hpp>
#include <loom/packing/wlb.hpp>
#include <loom/shard/plan.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

using loom::index_t;
namespace pk = loom::packing;

// Attention pairs plus per-token work: beta = 6 d for d = 4096 (24 d^2 FLOPs per token in the
// dense layers against 4 d per attention pair), in units of one causal pair.
const pk::cost_model model{1.0, 6.0 * 4096, 0.0};

std::optional<index_t> parse_positive(std::string_view s) {
  index_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v <= 0) return std::nullopt;
  return v;
}

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

// The lengths of the file, or an error message.
struct read_result {
  std::vector<index_t> lengths;
  std::string error;
};

read_result read_lengths(const std::string& path, index_t window) {
  std::ifstream in(path);
  if (!in) return {{}, "cannot open " + path};
  read_result r;
  std::string line;
  for (long number = 1; std::getline(in, line); ++number) {
    const auto text = trim(line);
    if (text.empty() || text.front() == '#') continue;
    const auto where = path + ":" + std::to_string(number) + ": ";
    const auto length = parse_positive(text);
    if (!length) return {{}, where + "expected a positive integer document length, got '" + std::string(text) + "'"};
    if (*length > window)
      return {{},
              where + "a document of " + std::to_string(*length) + " tokens is longer than the window " +
                  std::to_string(window) + "; split it first"};
    r.lengths.push_back(*length);
  }
  if (r.lengths.empty()) r.error = path + ": no document lengths";
  return r;
}

std::vector<double> costs(const std::vector<pk::micro_batch>& batches) {
  std::vector<double> c;
  for (const auto& b : batches) c.push_back(b.cost(model));
  return c;
}

// Per-step balance of one packer over the stream.
struct summary {
  double micro_batches = 0, mean_ratio = 0, worst_ratio = 0;
  int steps = 0;
  void add(const std::vector<pk::micro_batch>& batches) {
    const double r = pk::balance_of(costs(batches)).max_over_mean;
    micro_batches += static_cast<double>(batches.size());
    mean_ratio += r;
    worst_ratio = std::max(worst_ratio, r);
    ++steps;
  }
  void print(const char* name) const {
    std::printf("  %-34s %8.1f %10.3f %8.3f\n", name, micro_batches / steps, mean_ratio / steps, worst_ratio);
  }
};

double max_over_mean(const std::vector<double>& v) { return pk::balance_of(v).max_over_mean; }

template <class S>
std::vector<double> rank_pairs(const pk::micro_batch& mb, int ranks, S strategy) {
  const auto plan =
      loom::shard::make_plan(loom::segments(std::span<const loom::index_t>(mb.cu_seqlens)), ranks, strategy);
  std::vector<double> pairs;
  for (int r = 0; r < ranks; ++r) pairs.push_back(static_cast<double>(plan.rank(r).causal_pairs));
  return pairs;
}

int run(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "examples/05_packing/lengths.txt";
  const auto window = argc > 2 ? parse_positive(argv[2]) : std::optional<index_t>(32768);
  const auto n = argc > 3 ? parse_positive(argv[3]) : std::optional<index_t>(8);
  if (argc > 4 || !window || !n || *window > (index_t{1} << 30) || *n > 4096) {
    std::fprintf(stderr, "usage: %s [lengths.txt] [window 1..2^30] [micro_batches 1..4096]\n", argv[0]);
    return 2;
  }
  const auto [lengths, error] = read_lengths(path, *window);
  if (!error.empty()) {
    std::fprintf(stderr, "loom.example.packing: %s\n", error.c_str());
    return 2;
  }
  const int micro_batches = static_cast<int>(*n);
  const index_t total = std::accumulate(lengths.begin(), lengths.end(), index_t{0});

  // Cut the stream into steps of at most N * window tokens.
  std::vector<std::vector<pk::document>> steps(1);
  index_t step_tokens = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    if (step_tokens + lengths[i] > micro_batches * *window) {
      steps.emplace_back();
      step_tokens = 0;
    }
    steps.back().push_back({static_cast<index_t>(i), lengths[i]});
    step_tokens += lengths[i];
  }

  auto sorted = lengths;
  std::sort(sorted.begin(), sorted.end());
  std::printf("loom packing: %zu documents, %lld tokens from %s\n", lengths.size(), static_cast<long long>(total),
              path.c_str());
  std::printf("  lengths: min %lld, median %lld, max %lld; window W = %lld; steps: %zu, of <= %d x W tokens each\n",
              static_cast<long long>(sorted.front()), static_cast<long long>(sorted[sorted.size() / 2]),
              static_cast<long long>(sorted.back()), static_cast<long long>(*window), steps.size(), micro_batches);
  std::printf("  modelled cost of a document of l tokens: l (l + 1) / 2 causal pairs + %.0f l\n\n", model.beta);

  // WLB: outliers are documents of at least W / 4 tokens, held back (up to 2 steps) until N of
  // them can be spread one per micro-batch.
  pk::wlb_options o;
  o.micro_batches = micro_batches;
  o.token_cap = 2 * *window;
  o.outlier_thresholds = {std::max<index_t>(*window / 4, 1)};
  o.max_delay_steps = 2;
  o.cost = model;
  pk::wlb_packer wlb(o);

  const pk::bin_options bins{*window, pk::oversize::reject, 0};
  summary ffd_sum, bfd_sum, wlb_sum;
  std::vector<int> seen(lengths.size(), 0);
  auto record = [&](const std::vector<pk::micro_batch>& batches) {
    for (const auto& b : batches)
      for (index_t id : b.documents) ++seen[static_cast<std::size_t>(id)];
  };
  std::vector<pk::micro_batch> first_ffd, first_wlb;  // step 0, shown in detail
  std::size_t first_waiting = 0;
  for (const auto& step : steps) {
    std::vector<index_t> step_lengths;
    for (const auto& d : step) step_lengths.push_back(d.length);
    auto ffd = pk::first_fit_decreasing(step_lengths, bins);
    ffd_sum.add(ffd);
    bfd_sum.add(pk::best_fit_decreasing(step_lengths, bins));
    auto out = wlb.push(step);
    wlb_sum.add(out.micro_batches);
    record(out.micro_batches);
    if (first_wlb.empty()) {
      first_ffd = std::move(ffd);
      first_wlb = std::move(out.micro_batches);
      first_waiting = out.waiting.size();
    }
  }
  int flushes = 0;
  for (; wlb.pending() > 0; ++flushes) record(wlb.flush().micro_batches);

  std::printf("  %-34s %8s %10s %8s\n", "packer (per step)", "mbatches", "max/mean", "worst");
  ffd_sum.print("first_fit_decreasing, capacity W");
  bfd_sum.print("best_fit_decreasing, capacity W");
  wlb_sum.print("wlb_packer, N, cap 2W, delay <= 2");
  std::printf(
      "  (max/mean: modelled cost of the costliest micro-batch over the mean, averaged over the\n"
      "   steps; flush steps wlb_packer needed at the end for the documents it held back: %d)\n\n",
      flushes);

  std::printf("  step 0 in detail (wlb_packer held %zu documents of >= %lld tokens back for later steps)\n",
              first_waiting, static_cast<long long>(o.outlier_thresholds.front()));
  std::printf("  %11s  %-29s  %s\n", "", "FFD", "WLB");
  std::printf("  %11s  %8s %6s %13s  %8s %6s %13s\n", "micro-batch", "tokens", "docs", "cost (1e9)", "tokens", "docs",
              "cost (1e9)");
  for (std::size_t i = 0; i < std::max(first_ffd.size(), first_wlb.size()); ++i) {
    std::string row = "  " + std::string(11 - std::to_string(i).size(), ' ') + std::to_string(i);
    for (const auto* side : {&first_ffd, &first_wlb}) {
      char cell[64] = "";
      if (i < side->size()) {
        const auto& b = (*side)[i];
        std::snprintf(cell, sizeof cell, "  %8lld %6zu %13.3f", static_cast<long long>(b.tokens()), b.documents.size(),
                      b.cost(model) / 1e9);
      }
      row += cell;
    }
    std::printf("%s\n", row.c_str());
  }
  std::printf("  %11s  %29.3f  %29.3f\n\n", "max/mean", max_over_mean(costs(first_ffd)),
              max_over_mean(costs(first_wlb)));

  // Context parallelism inside the first WLB micro-batch: P ranks share its packed sequence.
  constexpr int ranks = 4;
  const auto& mb = first_wlb.front();
  const auto plan = loom::shard::make_plan(loom::segments(std::span<const loom::index_t>(mb.cu_seqlens)), ranks,
                                           loom::shard::per_document{});
  std::printf("  shard::per_document of WLB micro-batch 0 of step 0 (documents: %zu, tokens: %lld) on P = %d ranks\n",
              mb.documents.size(), static_cast<long long>(mb.tokens()), ranks);
  std::printf("  rank   tokens   causal pairs   pieces\n");
  std::vector<double> tokens, pairs;
  std::int64_t pair_sum = 0;
  index_t token_sum = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto& rp = plan.rank(r);
    std::printf("  %4d %8lld %14lld %8zu\n", r, static_cast<long long>(rp.tokens),
                static_cast<long long>(rp.causal_pairs), rp.pieces.size());
    tokens.push_back(static_cast<double>(rp.tokens));
    pairs.push_back(static_cast<double>(rp.causal_pairs));
    pair_sum += rp.causal_pairs;
    token_sum += rp.tokens;
  }
  std::printf("  max/mean: tokens %.4f, causal pairs %.4f (zigzag %.4f, contiguous %.4f on the same input)\n\n",
              max_over_mean(tokens), max_over_mean(pairs), max_over_mean(rank_pairs(mb, ranks, loom::shard::zigzag{})),
              max_over_mean(rank_pairs(mb, ranks, loom::shard::contiguous{})));

  // What this run checked: WLB emitted every document exactly once, and the shard plan holds
  // every token of the micro-batch and exactly its causal pairs.
  std::int64_t expected_pairs = 0;
  for (std::size_t i = 0; i + 1 < mb.cu_seqlens.size(); ++i)
    expected_pairs += pk::causal_pairs(mb.cu_seqlens[i + 1] - mb.cu_seqlens[i]);
  const bool once = std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; });
  const bool ok = once && token_sum == mb.tokens() && pair_sum == expected_pairs;
  std::printf(
      "  checked: every document emitted once by wlb_packer %s; shard plan holds %lld of %lld tokens and "
      "%lld of %lld causal pairs %s\n",
      once ? "OK" : "FAILED", static_cast<long long>(token_sum), static_cast<long long>(mb.tokens()),
      static_cast<long long>(pair_sum), static_cast<long long>(expected_pairs), ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const loom::error& e) {  // a planner refused its input
    std::fprintf(stderr, "loom.example.packing: %s\n", e.what());
    return 1;
  }
}
