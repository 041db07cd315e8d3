#!/usr/bin/env python3
"""Summarises an Nsight Compute SASS source page (one kernel launch):

    python3 scripts/ncu_sass_summary.py source.csv[.xz] [RUNS]

from `SASS=1 bash target/gpu-bundle/profile.sh OUT KERNEL_REGEX SKIP 1 [filters]` (see
scripts/gpu-bundle.sh). Prints the warp instructions executed per opcode (and per HMMA / HGMMA,
the tensor-core instruction, where there is one) with their stall samples, then the RUNS (default
12) straight-line runs of instructions that cost the most (executions x length), with their
opcode mix: where a kernel spends its issue slots and its stalls.
"""
import collections
import csv
import lzma
import re
import sys


def main():
    path = sys.argv[1]
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    head = next(r for r in rows if "Source" in r and "Instructions Executed" in r)
    data = rows[rows.index(head) + 1:]
    i_exec, i_src = head.index("Instructions Executed"), head.index("Source")
    i_stall = head.index("Warp Stall Sampling (All Samples)")

    def opcode(src):
        return re.sub(r"^@!?U?P\w+\s+", "", src.strip()).split(" ")[0].split(".")[0]

    per_op, stalls, seq = collections.Counter(), collections.Counter(), []
    for r in data:
        n, src, w = int(r[i_exec] or 0), r[i_src], int(r[i_stall] or 0)
        per_op[opcode(src)] += n
        stalls[opcode(src)] += w
        seq.append((n, src, w))
    total = sum(per_op.values())
    mma = per_op.get("HMMA", 0) or per_op.get("HGMMA", 0)
    print(f"warp instructions executed: {total}")
    for op, n in per_op.most_common(30):
        ratio = f"{n / mma:6.2f} per mma" if mma else ""
        print(f"  {op:10s} {n:14d} {ratio}  stall samples {stalls[op]}")
    segments = []
    for i, (n, src, w) in enumerate(seq):
        if segments and segments[-1][0] == n:
            segments[-1][2].append(src)
            segments[-1][3] += w
        else:
            segments.append([n, i, [src], w])
    segments.sort(key=lambda s: -s[0] * len(s[2]))
    print("costliest straight-line runs (executions x length):")
    for n, start, srcs, w in segments[:runs]:
        mix = collections.Counter(opcode(s) for s in srcs).most_common(8)
        print(f"  at {start:5d}: {len(srcs):4d} instructions x {n:10d} = {n * len(srcs):12d}, stalls {w:7d}  {mix}")


if __name__ == "__main__":
    main()
