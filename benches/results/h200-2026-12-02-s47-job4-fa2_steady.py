# SDPA flash (FlashAttention-2), causal bf16 b4 h16 d128, n = 4096 and 8192: forward and fwd+bwd,
# medians of 50 calls after the board's steady state (calls go on until WARM_MS ms of load have
# passed, as FASTOPS_BENCH_WARM_MS in benches/ops.rs), on freshly allocated operands.
import json, os, statistics, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WARM_MS = float(os.environ.get("FASTOPS_BENCH_WARM_MS", "600"))

def median_us(fn, warmup=10, iters=50):
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    while (time.perf_counter() - t0) * 1000.0 < WARM_MS:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0)
    return statistics.median(times)

for n in (4096, 8192):
    q, k, v = (torch.randn(4, 16, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(4, 16, n, 128, device="cuda", dtype=torch.bfloat16)
    def fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    print(json.dumps({"n": n, "warm_ms": WARM_MS, "forward_us": round(median_us(fwd), 1), "fwd_bwd_us": round(median_us(fwd_bwd), 1)}), flush=True)
    del q, k, v, grad
    torch.cuda.empty_cache()
