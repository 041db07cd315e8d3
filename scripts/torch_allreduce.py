"""PyTorch's NCCL all-reduce, the anchor of `ddp_train --allreduce-bench`: the same buffer (MiB of
f32, summed), 5 warm-up and 20 timed calls, median and bus bandwidth 2 (n - 1) / n * bytes / time.

    python3 -m torch.distributed.run --nproc_per_node 2 scripts/torch_allreduce.py 256 [OUT.jsonl]
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    out = sys.argv[2] if len(sys.argv) > 2 else None
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    buf = torch.ones((mib << 20) // 4, dtype=torch.float32, device="cuda")
    times = []
    for i in range(25):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(buf)
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    bus = 2 * (world - 1) / world * buf.numel() * 4 / median / 1e9
    if dist.get_rank() == 0:
        row = {"op": "all_reduce", "mib": mib, "ranks": world, "torch_us": median * 1e6,
               "bus_gb_s": bus, "what": f"torch.distributed.all_reduce (NCCL {torch.cuda.nccl.version()})"}
        print(json.dumps(row))
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
