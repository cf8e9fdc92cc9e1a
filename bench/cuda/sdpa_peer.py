"""PyTorch's scaled_dot_product_attention on the shapes of loom.bench.cudnn (bf16, 16 query heads on
4 kv heads, head dim 128, causal, one sequence of N tokens), on the GPU. Prints one line per N:
"N forward_ms backward_ms" (medians of CUDA-event timings after warm-up), which
loom.bench.cudnn --sdpa FILE reads. Exits 3 when PyTorch or a GPU is missing.

    python3 bench/cuda/sdpa_peer.py [--quick] > sdpa.txt
"""
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    sys.exit(3)
if not torch.cuda.is_available():
    sys.exit(3)


def median_ms(run, prepare=lambda: None, warm=3, reps=15):
    """Median milliseconds of run(prepare()) over reps calls; prepare() is not timed."""
    for _ in range(warm):
        run(prepare())
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        arg = prepare()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(arg)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    sizes = [1024] if "--quick" in sys.argv else [8192, 16384, 32768]
    hq, hk, d = 16, 4, 128
    for n in sizes:
        g = torch.Generator(device="cuda").manual_seed(7)
        q = (torch.rand(1, hq, n, d, device="cuda", generator=g) * 2 - 1).bfloat16().requires_grad_()
        k = (torch.rand(1, hk, n, d, device="cuda", generator=g) * 2 - 1).bfloat16().requires_grad_()
        v = (torch.rand(1, hk, n, d, device="cuda", generator=g) * 2 - 1).bfloat16().requires_grad_()
        dout = (torch.rand(1, hq, n, d, device="cuda", generator=g) * 2 - 1).bfloat16()

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def forward(_):
            with torch.no_grad():
                sdpa()

        fwd = median_ms(forward)
        bwd = median_ms(lambda out: out.backward(dout), prepare=sdpa)
        print(n, f"{fwd:.4f}", f"{bwd:.4f}", flush=True)


if __name__ == "__main__":
    main()
