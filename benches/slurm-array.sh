#!/usr/bin/env bash
# What sharding costs: 10,000 trivial points as one local sweep, against an
# array of 2 SLURM tasks (examples/sweep.sbatch, a CPU each) merged, on the
# same machine, interleaved: wall time from the command to the merged file.
#
#   benches/slurm-array.sh [ROUNDS]
#
# Needs SLURM up (.ci/slurm) and a release build (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
export PATH="$PWD/target/release:$PATH"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
node="$PWD/examples/square.py"
grid=(--grid x=0..9999)
now() { date +%s.%N; }

for round in $(seq "$rounds"); do
    rm -f "$work"/*.jsonl "$work"/*.log
    started=$(now)
    fluksio-zygote sweep "$node" "${grid[@]}" -j 2 -o "$work/local.jsonl" 2>/dev/null
    local_s=$(echo "$(now) - $started" | bc)

    started=$(now)
    job=$(sbatch --parsable --chdir="$work" --array=0-1 examples/sweep.sbatch \
        "$node" "${grid[@]}" -o "$work/array.jsonl")
    # Polled here: sbatch --wait sleeps between its own polls, up to 32 s.
    while [ -n "$(squeue -h -j "$job" 2>/dev/null)" ]; do sleep 0.1; done
    fluksio-zygote sweep "$node" "${grid[@]}" -o "$work/array.jsonl" --merge 2>/dev/null
    array_s=$(echo "$(now) - $started" | bc)

    [ "$(wc -l <"$work/array.jsonl")" -eq 10000 ] || { echo "the merge is short" >&2; exit 1; }
    printf 'round %d: local sweep -j 2 %6.2f s, array of 2 tasks + merge %6.2f s, ratio %.2f\n' \
        "$round" "$local_s" "$array_s" "$(echo "$array_s / $local_s" | bc -l)"
done
