#!/usr/bin/env bash
# Session 50, job 1 (H200; run with the study build: span.cu with STAGES and the mask copies as template parameters, FASTOPS_SPAN_VARIANT picking the kernels): study variants of the Hopper span kernels (raw stages 4/5/6; the
# partial tiles' mask copied into shared memory with its stage: s4m, s5m). masked_bmm tests per
# variant, ncu per variant (one call), a source-level ncu profile of the base kernels, and the
# bench case b=64 2048 k=64 f32 for every variant, alternately, three rounds.
set -u
OUT=${OUT:?}
source target/gpu-bundle/libs.sh
work=$(mktemp -d)
for b in test-ops bench-ops; do xz -dc target/gpu-bundle/bin/$b.xz > "$work/$b"; done; chmod +x "$work"/*
V="base s5 s6 s4m s5m"
for v in $V; do printf '#!/usr/bin/env bash\nFASTOPS_SPAN_VARIANT=%s exec %s "$@"\n' "$v" "$work/bench-ops" > "$work/v-$v"; chmod +x "$work/v-$v"; done
nvidia-smi -L | tee "$OUT/gpu.txt" >> "$OUT/summary.txt"
[ -d /work/main/src ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
for v in $V; do
  FASTOPS_SPAN_VARIANT=$v timeout 120 "$work/test-ops" masked_bmm --test-threads=4 > "$OUT/tests-$v.log" 2>&1
  echo "tests masked_bmm $v rc=$? $SECONDS s: $(grep 'test result' "$OUT/tests-$v.log" | tail -1)" | tee -a "$OUT/summary.txt"
  grep "panicked\|FAILED" "$OUT/tests-$v.log" | head -4 | tee -a "$OUT/summary.txt"
done
ncu=$(command -v ncu || find /opt /usr/local -name ncu -type f 2>/dev/null | head -n1)
export FASTOPS_BENCH_CASES="causal b=64 m=n=2048 k=64 f32"
for v in $V; do
  FASTOPS_SPAN_VARIANT=$v FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 100 "$ncu" --kernel-name regex:"span_grad" --metrics gpu__time_duration.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active --csv "$work/bench-ops" masked_bmm > "$OUT/ncu-$v.csv" 2>&1
  echo "ncu $v rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
  grep -E '"span' "$OUT/ncu-$v.csv" | awk -F'","' '{print $5, $(NF-2), $(NF)}' | sed 's/"//g' | cut -c1-140 | tee -a "$OUT/summary.txt"
done
FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_CALLS=0,1 timeout 200 "$ncu" --kernel-name regex:"span_grad" -c 2 --set full --import-source no -o "$OUT/full" "$work/bench-ops" masked_bmm > "$OUT/ncu-full.log" 2>&1
echo "ncu full rc=$? $SECONDS s" | tee -a "$OUT/summary.txt"
"$ncu" -i "$OUT/full.ncu-rep" --page details --section WarpStateStats --section SchedulerStats --section Occupancy > "$OUT/full-details.txt" 2>&1
grep -E "span_grad|Stall|Warp Cycles|Issued Warp|Eligible|Active Warps|No Eligible|Achieved Occ" "$OUT/full-details.txt" | head -60 | tee -a "$OUT/summary.txt"
"$ncu" -i "$OUT/full.ncu-rep" --page source --csv --print-source sass > "$OUT/full-source.csv" 2>&1
python3 - "$OUT/full-source.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys, io
text = open(sys.argv[1], errors="replace").read()
# one table per kernel, each starting with a header line holding "Source"
blocks, cur = [], []
for line in text.splitlines():
    if line.startswith('"#"') or line.startswith('"Address"') or ('"Source"' in line and cur and len(cur) > 1):
        if cur: blocks.append(cur)
        cur = [line]
    else:
        cur.append(line)
if cur: blocks.append(cur)
for bl in blocks:
    rows = list(csv.reader(io.StringIO("\n".join(bl))))
    if not rows: continue
    hdr = rows[0]
    print("HEADER", hdr[:12] if len(hdr) > 1 else hdr)
    try:
        si = hdr.index("Source")
        wi = [i for i, h in enumerate(hdr) if h.startswith("Warp Stall Sampling (All")][0]
    except Exception as e:
        print("no columns", e, hdr[:20]); continue
    data = []
    for r in rows[1:]:
        if len(r) <= wi: continue
        try: data.append((float(r[wi] or 0), r[si], r))
        except ValueError: pass
    tot = sum(d[0] for d in data) or 1
    print("kernel block: instructions", len(data), "samples", tot)
    stall_cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") or "Stall" in h]
    for w, src, r in sorted(data, key=lambda d: -d[0])[:28]:
        extra = " ".join(f"{hdr[i]}={r[i]}" for i in stall_cols[:0])
        print(f"{100*w/tot:5.1f}% {src[:90]}")
PY
bash scripts/ab-bench.sh "$OUT/ab" 3 masked_bmm base="$work/v-base" s5="$work/v-s5" s6="$work/v-s6" s4m="$work/v-s4m" s5m="$work/v-s5m" > /dev/null 2>&1
grep -v "round" "$OUT/ab/ab-summary.txt" | tee -a "$OUT/summary.txt"
echo "done $SECONDS s" | tee -a "$OUT/summary.txt"
rm -f "$OUT/full.ncu-rep.bak"
tar czf /tmp/logs.tgz -C "$OUT" --exclude=full.ncu-rep . && find "$OUT" -mindepth 1 ! -name summary.txt ! -name full.ncu-rep -delete && mv /tmp/logs.tgz "$OUT/"
