#!/usr/bin/env python3
"""Times PyTorch and SciPy on the shapes of loom's benchmarks (CPU, fp32) and writes one JSON file.

    python peers.py [--threads 1,2] [--out build/peers.json] [--quick] [--only attention,scan]

Run it through bench/peers/run, which makes the virtual environment with torch, scipy and numpy.
bench/report reads the JSON (--peers) and sets the rows beside loom's on the same shapes and
thread counts. Groups (--only):

  attention  torch.nn.functional.scaled_dot_product_attention, causal, H = 16 query heads,
             Hkv = 4 (GQA), d = 128, T = 4096 and 8192: one document of T tokens, and the same T
             packed as 4 documents, one call per document; forward and backward. Also loom's own
             attention bench shape (N = 8192, 8 heads, d = 128, causal and full).
  decode     one query token per sequence, 32 sequences x 32768 keys, H = 16, Hkv = 4, d = 128.
  scan       torch.cumsum of 64M (and 16M) fp32.
  spmm       M = 4096, K in {4096, 11008}, N in {1, 8, 16, 64}, 80 % and 90 % zeros per row
             (magnitude-pruned uniform weights): torch sparse CSR @ dense, scipy.sparse CSR @
             dense, and torch.matmul on the dense matrix.

Timing: each row runs its call once untimed (warm-up), then times `repetitions` runs; a run is
as many back-to-back calls as fill --min-time (one call when a call takes longer), and its
figure is the time per call. The row's time is the median run, its spread the coefficient of
variation over the runs. --quick uses small shapes (a smoke test: its rows match none of loom's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import scipy
import scipy.sparse
import torch
import torch.nn.functional as F

SCHEMA = 1
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


# ----------------------------------------------------------------------------------------------
# Timing


def measure(fn, min_time: float, repetitions: int) -> dict:
    """Median seconds per call of `fn` over `repetitions` runs, after one untimed warm-up call."""
    fn()  # warm-up: first-touch allocation, thread pool start, kernel selection
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    calls = 1 if first >= min_time else max(1, math.ceil(min_time / max(first, 1e-9)))
    runs = [first] if calls == 1 else []  # a call as long as a run is already a timed run
    while len(runs) < repetitions:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    mean = statistics.fmean(runs)
    return {
        "time_s": statistics.median(runs),
        "cv": statistics.stdev(runs) / mean if len(runs) > 1 and mean > 0 else None,
        "runs": len(runs),
        "calls_per_run": calls,
    }


def busy_cores(seconds: float = 1.0) -> float | None:
    """Cores other work kept busy over `seconds` just now (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (1.0 - (idle1 - idle0) / total) * (os.cpu_count() or 1) if total > 0 else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Recorder:
    def __init__(self, args):
        self.args = args
        self.rows: list[dict] = []

    def add(self, family: str, params: dict, threads: int, timing: dict, counters: dict | None = None,
            note: str = "") -> None:
        params = {k: str(v) for k, v in params.items()}
        params["threads"] = str(threads)
        row = {"family": family, "params": params, **timing, "counters": counters or {}}
        if note:
            row["note"] = note
        self.rows.append(row)
        shown = "/".join(f"{k}:{v}" for k, v in params.items())
        extra = "".join(f"  {k} {v:.4g}" for k, v in (counters or {}).items())
        print(f"{family}/{shown}  {timing['time_s'] * 1e3:.3f} ms{extra}", file=sys.stderr, flush=True)

    def time(self, fn):
        return measure(fn, self.args.min_time, self.args.repetitions)


# ----------------------------------------------------------------------------------------------
# Attention

# Fixed document lengths of the packed rows (4 documents, summing to T).
PACKED = {
    8192: [3000, 2500, 1500, 1192],
    4096: [1500, 1250, 750, 596],
    2048: [750, 625, 375, 298],
    1024: [375, 313, 187, 149],
}


def sdpa_backend(q, k, v, causal: bool, gqa: bool) -> str:
    """The fused backend the default dispatch picks for these inputs: 'flash' or 'math'."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return "unknown"
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            F.scaled_dot_product_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], is_causal=causal,
                                           **({"enable_gqa": True} if gqa else {}))
        return "flash"
    except RuntimeError:
        return "math"


def supports_enable_gqa() -> bool:
    q, kv = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except TypeError:
        return False


class Attention:
    """q, k, v and the output gradient of documents of the given lengths, [1, heads, L, d] each,
    contiguous (torch's layout), separate tensors per document; k/v with `kv_heads` heads."""

    def __init__(self, lengths: list[int], heads: int, kv_heads: int, dim: int, causal: bool, gqa: str, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.causal, self.heads, self.kv_heads, self.dim = causal, heads, kv_heads, dim
        self.kwargs = {"is_causal": causal}
        if kv_heads != heads and gqa == "enable_gqa":
            self.kwargs["enable_gqa"] = True
        self.docs = []
        for length in lengths:
            q = torch.rand(1, heads, length, dim, generator=g) * 2 - 1
            k = torch.rand(1, kv_heads, length, dim, generator=g) * 2 - 1
            v = torch.rand(1, kv_heads, length, dim, generator=g) * 2 - 1
            if kv_heads != heads and gqa == "repeat_interleave":  # expanded here, outside every timing
                k = k.repeat_interleave(heads // kv_heads, dim=1).contiguous()
                v = v.repeat_interleave(heads // kv_heads, dim=1).contiguous()
            dout = torch.rand(1, heads, length, dim, generator=g) * 2 - 1
            self.docs.append([q, k, v, dout])
        self.outs: list[torch.Tensor] = []

    def forward(self) -> None:
        with torch.no_grad():
            for q, k, v, _ in self.docs:
                F.scaled_dot_product_attention(q, k, v, **self.kwargs)

    def prepare_backward(self) -> None:
        """One forward with autograd on; its graphs are kept (retain_graph) for the timed backwards."""
        for d in self.docs:
            for t in d[:3]:
                t.requires_grad_(True)
        self.outs = [F.scaled_dot_product_attention(q, k, v, **self.kwargs) for q, k, v, _ in self.docs]

    def backward(self) -> None:
        for (q, k, v, dout), out in zip(self.docs, self.outs):
            q.grad = k.grad = v.grad = None  # fresh gradients, no accumulation into the last ones
            out.backward(dout, retain_graph=True)

    def release(self) -> None:
        self.outs = []
        for d in self.docs:
            for t in d[:3]:
                t.grad = None
                t.requires_grad_(False)


def pairs(lengths: list[int], causal: bool) -> float:
    return float(sum(n * (n + 1) // 2 if causal else n * n for n in lengths))


def attention_rows(rec: Recorder, family: str, params: dict, lengths: list[int], heads: int, kv_heads: int,
                   causal: bool, passes: list[str], gqa: str, threads_list: list[int]) -> None:
    att = Attention(lengths, heads, kv_heads, 128, causal, gqa, seed=len(lengths) * 7919 + sum(lengths))
    flops = 4.0 * 128 * heads * pairs(lengths, causal)
    q, k, v, _ = att.docs[0]
    backend = sdpa_backend(q, k, v, causal, "enable_gqa" in att.kwargs)
    note = f"backend {backend}" + (f"; GQA by {gqa}" if kv_heads != heads else "")
    for threads in threads_list:
        torch.set_num_threads(threads)
        if "forward" in passes:
            t = rec.time(att.forward)
            rec.add(family, {**params, "pass": "forward"}, threads, t, {"GFLOP/s": flops / t["time_s"] * 1e-9}, note)
        if "backward" in passes:
            att.prepare_backward()
            t = rec.time(att.backward)
            # GFLOP/s at the forward's count, like loom's backward row: time ratios read directly.
            rec.add(family, {**params, "pass": "backward"}, threads, t, {"GFLOP/s": flops / t["time_s"] * 1e-9}, note)
            att.release()
    del att


def attention(rec: Recorder, quick: bool, gqa: str) -> None:
    lengths = [1024, 2048] if quick else [4096, 8192]
    passes = ["forward", "backward"]
    for t in lengths:
        for docs in ([t], PACKED[t]):
            attention_rows(rec, "peer.attention.sdpa", {"T": t, "H": 16, "Hkv": 4, "d": 128, "causal": 1,
                                                        "docs": len(docs), "lengths": "+".join(map(str, docs))},
                           docs, 16, 4, True, passes, gqa, rec.args.threads)
    # loom's own attention bench: N = 8192, 8 heads (no GQA), d = 128, causal and full.
    n = 2048 if quick else 8192
    for causal in (1, 0):
        attention_rows(rec, "peer.attention.sdpa_mha", {"N": n, "H": 8, "d": 128, "causal": causal}, [n], 8, 8,
                       bool(causal), passes, gqa, rec.args.threads)


def decode(rec: Recorder, quick: bool, gqa: str) -> None:
    """One new token per sequence against its whole cache (no mask: the query is the last position).

    grouped_rows: the 4 query heads that share a kv head are the 4 query rows of one SDPA head,
    q [B, Hkv, 4, d] against k/v [B, Hkv, S, d]: the same arithmetic, with no expansion at all.
    enable_gqa: q [B, H, 1, d] against k/v [B, Hkv, S, d] with enable_gqa=True."""
    batch, keys = (4, 4096) if quick else (32, 32768)
    heads, kv_heads, dim = 16, 4, 128
    g = torch.Generator().manual_seed(17)
    q = torch.rand(batch, heads, 1, dim, generator=g) * 2 - 1
    k = torch.rand(batch, kv_heads, keys, dim, generator=g) * 2 - 1
    v = torch.rand(batch, kv_heads, keys, dim, generator=g) * 2 - 1
    grouped = q.view(batch, kv_heads, heads // kv_heads, dim)  # heads h = g * 4 + j, as enable_gqa groups them
    flops = 4.0 * dim * heads * batch * keys
    kv_bytes = 2.0 * 4 * batch * kv_heads * keys * dim
    params = {"B": batch, "S": keys, "H": heads, "Hkv": kv_heads, "d": dim}
    variants = [("grouped_rows", lambda: F.scaled_dot_product_attention(grouped, k, v))]
    if gqa == "enable_gqa":
        variants.append(("enable_gqa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
    for threads in rec.args.threads:
        torch.set_num_threads(threads)
        for name, fn in variants:
            with torch.no_grad():
                t = rec.time(fn)
            rec.add("peer.attention.sdpa_decode", {**params, "method": name}, threads, t,
                    {"GFLOP/s": flops / t["time_s"] * 1e-9, "GB/s": kv_bytes / t["time_s"] * 1e-9},
                    "no GQA expansion" if name == "grouped_rows" else "enable_gqa=True")


# ----------------------------------------------------------------------------------------------
# Scan


def scan(rec: Recorder, quick: bool) -> None:
    for n in ([1 << 22] if quick else [64 << 20, 16 << 20]):
        x = (torch.arange(n, dtype=torch.int64) % 7 - 3).to(torch.float32)  # scan_bench.cpp's values
        y = torch.empty_like(x)
        for threads in rec.args.threads:
            torch.set_num_threads(threads)
            t = rec.time(lambda: torch.cumsum(x, 0, out=y))
            rec.add("peer.scan.cumsum", {"n": n}, threads, t, {"GB/s": 8.0 * n / t["time_s"] * 1e-9, "elements": n})
        del x, y


# ----------------------------------------------------------------------------------------------
# SpMM


def pruned(m: int, k: int, pct: int, seed: int) -> np.ndarray:
    """Uniform(-1, 1) weights with round(pct % of k) smallest magnitudes zeroed in every row."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1, 1, size=(m, k)).astype(np.float32)
    zeros = int(round(pct / 100 * k))
    if zeros:
        idx = np.argpartition(np.abs(a), zeros - 1, axis=1)[:, :zeros]
        np.put_along_axis(a, idx, 0.0, axis=1)
    return a


def spmm(rec: Recorder, quick: bool) -> None:
    shapes = [(1024, 1024)] if quick else [(4096, 4096), (4096, 11008)]
    widths = [1, 16] if quick else [1, 8, 16, 64]
    sparsities = [90] if quick else [80, 90]
    for m, k in shapes:
        dense_w = torch.from_numpy(np.random.default_rng(42).uniform(-1, 1, size=(m, k)).astype(np.float32))
        for n in widths:
            b_np = np.random.default_rng(7).uniform(-1, 1, size=(k, n)).astype(np.float32)
            b = torch.from_numpy(b_np)
            for threads in rec.args.threads:
                torch.set_num_threads(threads)
                with torch.no_grad():
                    t = rec.time(lambda: torch.matmul(dense_w, b))
                rec.add("peer.sparse.torch_dense", {"M": m, "K": k, "N": n}, threads, t,
                        {"GFLOP/s": 2.0 * m * k * n / t["time_s"] * 1e-9})
        del dense_w
        for pct in sparsities:
            a = pruned(m, k, pct, seed=1000 + pct)
            a_sp = scipy.sparse.csr_matrix(a)
            a_csr = torch.from_numpy(a).to_sparse_csr()
            del a
            for n in widths:
                b_np = np.random.default_rng(7).uniform(-1, 1, size=(k, n)).astype(np.float32)
                b = torch.from_numpy(b_np)
                params = {"M": m, "K": k, "N": n, "s": pct}
                rate = 2.0 * m * k * n * 1e-9  # the dense FLOP count, as loom's sparse rows
                for threads in rec.args.threads:
                    torch.set_num_threads(threads)
                    with torch.no_grad():
                        t = rec.time(lambda: torch.sparse.mm(a_csr, b))
                    rec.add("peer.sparse.torch_csr", params, threads, t, {"GFLOP/s": rate / t["time_s"]})
                # scipy's CSR x dense kernel is single-threaded: one row, threads 1.
                t = rec.time(lambda: a_sp @ b_np)
                rec.add("peer.sparse.scipy_csr", params, 1, t, {"GFLOP/s": rate / t["time_s"]},
                        "single-threaded (scipy.sparse)")


# ----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--threads", default="1,2", help="thread counts, comma-separated (torch.set_num_threads; default 1,2)")
    add("--out", type=Path, default=Path("build/peers.json"), help="JSON to write (default build/peers.json)")
    add("--quick", action="store_true", help="small shapes: a smoke run of a minute or two")
    add("--only", default="attention,decode,scan,spmm", help="groups to run, comma-separated")
    add("--min-time", type=float, default=None, help="seconds per timed run (default 0.5, --quick 0.05)")
    add("--repetitions", type=int, default=None, help="timed runs per row, the median is kept (default 3)")
    add("--gqa", choices=["auto", "enable_gqa", "repeat_interleave"], default="auto",
        help="how the attention rows give SDPA the 4 kv heads: enable_gqa=True, or k/v expanded by "
             "repeat_interleave outside the timing (auto: enable_gqa where this torch has it)")
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    args.min_time = args.min_time if args.min_time is not None else (0.05 if args.quick else 0.5)
    args.repetitions = args.repetitions or 3
    groups = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = set(groups) - {"attention", "decode", "scan", "spmm"}
    if unknown:
        parser.error(f"unknown groups: {', '.join(sorted(unknown))}")
    gqa = args.gqa
    if gqa == "auto":
        gqa = "enable_gqa" if supports_enable_gqa() else "repeat_interleave"
    elif gqa == "enable_gqa" and not supports_enable_gqa():
        parser.error(f"torch {torch.__version__} has no enable_gqa")

    doc = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": sys.argv[1:],  # bench/peers/run passes its own options on unchanged
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "scipy": scipy.__version__,
            "numpy": np.__version__,
        },
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "threads": args.threads,
        "torch_parallel_backend": next((line.split(":", 1)[1].strip() for line in
                                        torch.__config__.parallel_info().splitlines()
                                        if line.startswith("ATen parallel backend")), ""),
        "torch_mkl": torch.backends.mkl.is_available(),
        "quick": args.quick,
        "min_time_s": args.min_time,
        "repetitions": args.repetitions,
        "gqa": gqa,
        "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else [],
        "busy_cores_before": busy_cores(),
        "rows": [],
    }
    rec = Recorder(args)
    started = time.perf_counter()
    if "attention" in groups:
        attention(rec, args.quick, gqa)
    if "decode" in groups:
        decode(rec, args.quick, gqa)
    if "scan" in groups:
        scan(rec, args.quick)
    if "spmm" in groups:
        spmm(rec, args.quick)
    doc["rows"] = rec.rows
    doc["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({len(rec.rows)} rows, {doc['seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
