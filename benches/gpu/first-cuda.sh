#!/usr/bin/env bash
# The first CUDA result of a call, on a real GPU: a cold `python` +
# `import torch` against a sweep's GPU slot without and with --cuda-warm,
# and the call after one that was killed (SIGKILL: one child lost, the
# zygote and its warm standbys kept).
#
#   benches/gpu/first-cuda.sh [PYTHON_WITH_TORCH] [GPU]
#
# Needs an NVIDIA GPU, torch with CUDA in PYTHON's environment (a venv:
# python3 -m venv V && V/bin/pip install torch), and the release binary
# (built here if cargo is present). Prints one line per case: the median
# and the spread over the calls, in milliseconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${1:-python3}"
gpu="${2:-0}"
binary=target/release/fluksio-zygote
if command -v cargo >/dev/null; then
    PYO3_PYTHON="$("$python" -c 'import sys; print(sys.base_prefix)')/bin/python3" \
        cargo build --release --quiet
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Each call times its first CUDA result from its own start (the context
# made then, unless its standby made it ahead), then rests so that the next
# call's standby, forked beside this one, has time to warm.
cat >"$work/node.py" <<'PY'
import os, signal, time
import torch

def process(x, kill_at=-1, rest=0.5):
    started = time.perf_counter()
    if x == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    value = (torch.ones(1 << 20, device="cuda") * 2).sum().item()
    first_ms = (time.perf_counter() - started) * 1000
    time.sleep(rest)
    return {"x": x, "first_cuda_ms": first_ms, "value": value}
PY

summarise() {  # NAME, then result lines on stdin
    "$python" -c '
import json, statistics, sys
name = sys.argv[1]
ms = [json.loads(l)["result"]["first_cuda_ms"] for l in sys.stdin if json.loads(l).get("ok")]
if not ms:
    sys.exit(f"{name}: no call succeeded")
print(f"{name:44s} median {statistics.median(ms):8.1f} ms  min {min(ms):8.1f}  max {max(ms):8.1f}  ({len(ms)} calls)")
' "$1"
}

echo "GPU $gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader -i "$gpu" 2>/dev/null || echo unknown)"
cold=()
for _ in 1 2 3 4 5; do
    cold+=("$(CUDA_VISIBLE_DEVICES="$gpu" "$python" -c '
import time; started = time.perf_counter()
import torch
(torch.ones(1 << 20, device="cuda") * 2).sum().item()
print((time.perf_counter() - started) * 1000)')")
done
printf '%s\n' "${cold[@]}" | "$python" -c '
import statistics, sys
ms = [float(l) for l in sys.stdin]
print(f"{\"cold python + import torch + first result\":44s} median {statistics.median(ms):8.1f} ms  min {min(ms):8.1f}  max {max(ms):8.1f}  ({len(ms)} runs)")'

# Exit 1 (a call failed) is expected where a call is killed.
sweep() {
    local code=0
    "$binary" sweep "$work/node.py" --python "$python" --preload torch \
        --gpus "$gpu" --per-gpu 1 "$@" 2>"$work/stderr" || code=$?
    if [ "$code" -gt 1 ]; then
        cat "$work/stderr" >&2
        return 1
    fi
}
sweep --grid x=0..9 | summarise "slot, context made by the call"
sweep --grid x=0..9 --cuda-warm | summarise "slot, --cuda-warm"
# x=3 kills its own child; the calls after it are served as before.
sweep --grid x=0..9 -k kill_at=3 --cuda-warm | "$python" -c '
import json, sys
for line in sys.stdin:
    line = json.loads(line)
    if line["index"] > 3:
        print(json.dumps(line))' | summarise "slot, --cuda-warm, after a SIGKILLed call"
