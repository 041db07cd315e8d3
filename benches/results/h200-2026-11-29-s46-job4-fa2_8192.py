# SDPA flash (FlashAttention-2) causal bf16 b4 h16 n8192 d128, forward and fwd+bwd: ROUNDS
# rounds, each on freshly allocated q / k / v (the earlier ones kept alive, so that every round's
# operands lie at new addresses), timed like scripts/torch_anchors.py (medians of 50 calls).
import json, statistics, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

def median_us(fn, warmup=10, iters=50):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0)
    return statistics.median(times)

keep = []
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    q, k, v = (torch.randn(4, 16, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(4, 16, 8192, 128, device="cuda", dtype=torch.bfloat16)
    keep.append((q, k, v, grad))
    def fwd():
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    print(json.dumps({"round": r, "forward_us": round(median_us(fwd), 1), "fwd_bwd_us": round(median_us(fwd_bwd), 1)}), flush=True)
