#!/usr/bin/env bash
# A/B timing of bench binaries in one GPU job (the binaries alternately, so that clock and
# thermal drift fall on every variant alike):
#
#     bash scripts/ab-bench.sh OUTDIR ROUNDS SECTION NAME=PATH[.xz] NAME=PATH[.xz] ...
#
# SECTION is the bench's section filter (e.g. masked_attention); FASTOPS_BENCH_CASES, when set,
# narrows its cases. Each binary runs with FASTOPS_BENCH_NO_BASELINE=1 (ours only), ROUNDS times;
# rows go to OUTDIR/ab-NAME-ROUND.jsonl, and OUTDIR/ab-summary.txt gets one line per case and dtype with
# every variant's medians in run order. Needs the CUDA libraries of target/gpu-bundle/libs.sh.
set -u
out=${1:?usage: ab-bench.sh OUTDIR ROUNDS SECTION NAME=PATH...}
rounds=${2:?rounds}
section=${3:?section}
shift 3
mkdir -p "$out"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$repo/target/gpu-bundle/libs.sh"
work=$(mktemp -d)
names=()
for spec in "$@"; do
    name=${spec%%=*}
    path=${spec#*=}
    case "$path" in
        *.xz) xz -dc "$path" > "$work/$name" ;;
        *) cp "$path" "$work/$name" ;;
    esac
    chmod +x "$work/$name"
    names+=("$name")
done
start=$SECONDS
for round in $(seq 1 "$rounds"); do
    for name in "${names[@]}"; do
        (cd "$repo" && FASTOPS_BENCH_NO_BASELINE=1 FASTOPS_BENCH_OUT="$out/ab-$name-$round.jsonl" \
            "$work/$name" "$section") > "$out/ab-$name-$round.log" 2>&1
        echo "$name round $round rc=$? $((SECONDS - start))s" | tee -a "$out/ab-summary.txt"
    done
done
python3 - "$out" "$rounds" "${names[@]}" <<'PY' | tee -a "$out/ab-summary.txt"
import json, os, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
table = {}
for name in names:
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"ab-{name}-{r}.jsonl")
        if not os.path.exists(path):
            continue
        for line in open(path):
            row = json.loads(line)
            table.setdefault(f'{row["case"]} {row.get("dtype", "")}'.strip(), {}).setdefault(name, []).append(row["median_us"])
for case in sorted(table):
    cells = "  ".join(f"{n}: " + "/".join(f"{x:.0f}" for x in table[case].get(n, [])) for n in names)
    print(f"{case:64s} {cells}")
PY
rm -rf "$work"
