#!/usr/bin/env python3
"""PyTorch anchors for the headline rows of BENCHMARKS.md, timed in the same job as the bench.

Usage (on the GPU machine, by target/gpu-bundle/run.sh when torch imports):
    python3 scripts/torch_anchors.py OUT.jsonl [filter...]

Each case is what a PyTorch user writes for the op (no custom kernels), timed like the bench:
CUDA events around each call, 10 warm-up calls, the median of 50 (fewer for the slow cases).
One JSON line per case: {"op", "case", "dtype", "torch_us", "what"}. Filters select cases whose
op contains one of them, as the bench's do.
"""
import json
import os
import statistics
import sys
import time

import torch


# Milliseconds of calls before a case is timed (STEADY_WARM_MS of benches/ops.rs).
STEADY_WARM_MS = 500


def median_us(fn, warmup=10, iters=50):
    warm_start = time.perf_counter()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    # Calls go on until FASTOPS_BENCH_WARM_MS (default STEADY_WARM_MS) ms after the warm-up
    # began: the board's steady state under its power cap, as benches/ops.rs times its own.
    warm_ms = float(os.environ.get("FASTOPS_BENCH_WARM_MS", STEADY_WARM_MS))
    while (time.perf_counter() - warm_start) * 1000.0 < warm_ms:
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def cases():
    dev = "cuda"
    f32, bf16 = torch.float32, torch.bfloat16

    def bias_add():
        x = torch.randn(16384, 4096, device=dev)
        b = torch.randn(4096, device=dev)
        yield "bias_add", "[16384, 4096] dim 1", "f32", "x + b", lambda: x + b
        xh, bh = x.to(bf16), b.to(bf16)
        yield "bias_add", "[16384, 4096] dim 1", "bf16", "x + b", lambda: xh + bh

    def softmax():
        x = torch.randn(32, 1024, 4096, device=dev)
        yield "softmax", "[32,1024,4096] dims [2]", "f32", "torch.softmax(x, -1)", lambda: torch.softmax(x, -1)

        def dims02():
            y = torch.softmax(x.permute(1, 0, 2).reshape(1024, -1), -1)
            return y.reshape(1024, 32, 4096).permute(1, 0, 2).contiguous()

        yield "softmax", "[32,1024,4096] dims [0, 2]", "f32", "permute + softmax + permute", dims02
        z = torch.randn(8, 16, 32, 64, 128, device=dev)

        def dims13():
            y = torch.softmax(z.permute(0, 2, 4, 1, 3).reshape(8 * 32 * 128, -1), -1)
            return y.reshape(8, 32, 128, 16, 64).permute(0, 3, 1, 4, 2).contiguous()

        yield "softmax", "[8,16,32,64,128] dims [1, 3]", "f32", "permute + softmax + permute", dims13

    def sparse_linear():
        batch, inputs, out, active = 16384, 22528, 1024, 32
        idx = torch.randint(0, inputs, (batch, active), device=dev)
        for dtype, name in ((f32, "f32"), (bf16, "bf16")):
            bag = torch.nn.EmbeddingBag(inputs, out, mode="sum").to(dev, dtype)
            bias = torch.randn(out, device=dev, dtype=dtype)
            yield ("sparse_linear", "22528->1024 x32 b16384 forward", name, "embedding_bag(sum) + bias",
                   lambda bag=bag, bias=bias: bag(idx) + bias)
            grad = torch.randn(batch, out, device=dev, dtype=dtype)

            def fwd_bwd(bag=bag, bias=bias, grad=grad):
                bag.weight.grad = None
                (bag(idx) + bias).backward(grad)

            yield ("sparse_linear", "22528->1024 x32 b16384 forward+backward", name,
                   "embedding_bag(sum) + bias, autograd", fwd_bwd)

    def masked_bmm():
        for b, n, k in ((64, 2048, 64), (16, 4096, 128)):
            mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().logical_not()
            for dtype, name in ((f32, "f32"), (bf16, "bf16")):
                a = torch.randn(b, n, k, device=dev, dtype=dtype)
                bt = torch.randn(b, k, n, device=dev, dtype=dtype)
                yield ("masked_bmm", f"causal b={b} m=n={n} k={k}", name, "bmm + masked_fill(-inf)",
                       lambda a=a, bt=bt: torch.bmm(a, bt).masked_fill_(mask, float("-inf")))

    def kmeans():
        for n, c, d in ((1 << 20, 4096, 128), (1 << 20, 16384, 64)):
            x = torch.randn(n, d, device=dev)
            cent = torch.randn(c, d, device=dev)
            half = (cent * cent).sum(1)

            def assign(x=x, cent=cent, half=half):
                out = torch.empty(x.shape[0], dtype=torch.long, device=dev)
                for s in range(0, x.shape[0], 1 << 16):
                    scores = torch.addmm(half, x[s:s + (1 << 16)], cent.t(), alpha=-2.0)
                    out[s:s + (1 << 16)] = scores.argmin(1)
                return out

            yield "kmeans_assign", f"n={n} c={c} d={d}", "f32", "chunked addmm + argmin", assign

    def optimizer():
        # The GPT-2-medium parameter set of the bench (354M in 289 tensors): fused AdamW.
        shapes = [(50257, 1024)]
        for _ in range(24):
            shapes += [(1024,), (1024,), (1024, 3072), (3072,), (1024, 1024), (1024,), (1024,),
                       (1024,), (1024, 4096), (4096,), (4096, 1024), (1024,)]
        params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
        total = sum(p.numel() for p in params)
        yield ("small_fc_lopt", f"{total / 1e6:.0f}M/{len(params)} AdamW", "f32", "torch.optim.AdamW(fused=True).step",
               opt.step)

    def attention():
        # The bench's cases: bf16, batch 4, 16 heads, head dim 128 (and causal 4096 at 64). SDPA's flash and cuDNN backends
        # for causal masks, FlexAttention (compiled, with a block mask) for every mask, and the
        # bool-mask SDPA a user without FlexAttention writes for the sparse masks.
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            flex = torch.compile(flex_attention)
            # Each case (shape, mask, grad mode) compiles its own kernel; past dynamo's default of
            # 8 recompiles, flex_attention falls back to an unfused form that materialises scores.
            torch._dynamo.config.recompile_limit = 64
        except Exception as e:  # no FlexAttention in this torch: the other anchors still run
            print(f"FlexAttention unavailable: {e}", file=sys.stderr, flush=True)
            flex = None
        b, h = 4, 16

        def causal(b_, h_, qi, kj):
            return qi >= kj

        def window(b_, h_, qi, kj):
            return (qi >= kj) & (qi - kj < 1024)

        def documents(b_, h_, qi, kj):
            return (qi >= kj) & (qi // 1024 == kj // 1024)

        for name, n, d, mask_mod in (("causal", 4096, 128, causal), ("causal", 8192, 128, causal),
                                     ("window 1024", 8192, 128, window),
                                     ("documents 1024 causal", 8192, 128, documents), ("causal", 4096, 64, causal)):
            q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
            grad = torch.randn(b, h, n, d, device=dev, dtype=bf16)
            case = f"{name} b={b} h={h} n={n} d={d}"

            def forward(f):
                def run():
                    with torch.no_grad():
                        return f()
                return run

            def fwd_bwd(f):
                def run():
                    q.grad = k.grad = v.grad = None
                    f().backward(grad)
                return run

            variants = []
            if name == "causal":
                for backend, label in ((SDPBackend.FLASH_ATTENTION, "SDPA flash"),
                                       (SDPBackend.CUDNN_ATTENTION, "SDPA cuDNN")):
                    def sdpa(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    variants.append((label, sdpa))
            else:
                qi = torch.arange(n, device=dev)[:, None]
                kj = torch.arange(n, device=dev)[None, :]
                bool_mask = mask_mod(None, None, qi, kj)

                def masked(bool_mask=bool_mask):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
                variants.append(("SDPA bool mask", masked))
            if flex is not None:
                block_mask = create_block_mask(mask_mod, None, None, n, n, device=dev)

                def flexed(block_mask=block_mask):
                    return flex(q, k, v, block_mask=block_mask)
                variants.append(("FlexAttention (compiled)", flexed))
            for label, f in variants:
                yield "masked_attention", f"{case} forward", "bf16", label, forward(f)
                yield "masked_attention", f"{case} fwd+bwd", "bf16", label + ", autograd", fwd_bwd(f)

    for family in (bias_add, softmax, sparse_linear, masked_bmm, kmeans, optimizer, attention):
        yield from family()


def main():
    out_path = sys.argv[1]
    filters = sys.argv[2:]
    with open(out_path, "w") as out:
        for op, case, dtype, what, fn in cases():
            if filters and not any(f in op for f in filters):
                continue
            slow = op in ("kmeans_assign",)
            try:
                us = median_us(fn, warmup=3 if slow else 10, iters=10 if slow else 50)
            except Exception as e:  # one anchor that fails (a backend missing here) is reported, not fatal
                print(f"anchor failed: {op} / {case} / {what}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
                continue
            row = {"op": op, "case": case, "dtype": dtype, "torch_us": round(us, 1), "what": what}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
