"""torch preloaded in the zygote: per call, against a cold python + import
torch + the same call, side by side in one run (CPU: torch's default PyPI
wheel; CUDA is never initialised in the zygote).

    python3 benches/torch_calls.py VENV/bin/python [--calls 200]

Needs a release build (cargo build --release) and torch in VENV.
"""

import argparse
import json
import os
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "fluksio-zygote")
NODE = "import torch\ndef process(n):\n    return [float(torch.ones(n).sum()), torch.cuda.is_initialized()]\n"
COLD = "import torch\nprint(float(torch.ones(8).sum()))\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("python")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    worker = subprocess.Popen(
        [BINARY, "worker", "--python", args.python, "--preload", "torch"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ, RUST_LOG="warn"),
    )

    def call(i):
        worker.stdin.write(json.dumps({"id": i, "op": "run", "flow": "b", "node": "t", "source": NODE, "kwargs": {"n": 8}}) + "\n")
        worker.stdin.flush()
        return json.loads(worker.stdout.readline())

    assert call(0)["result"] == [8.0, False]
    for gap in (0.0, 0.005):
        times = []
        for i in range(args.calls):
            began = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - began)
            time.sleep(gap)
        times.sort()
        label = "back to back" if gap == 0 else "spaced 5 ms apart"
        print(f"ours, {label}: p50 {times[len(times) // 2] * 1000:.2f} ms, p99 {times[int(len(times) * 0.99)] * 1000:.2f} ms")
    status = dict(line.split(":", 1) for line in open(f"/proc/{worker.pid}/status"))
    print(f"zygote RSS {status['VmRSS'].strip()}, anonymous {status['RssAnon'].strip()}")
    worker.stdin.close()
    worker.wait()
    cold = []
    for _ in range(5):
        began = time.perf_counter()
        subprocess.run([args.python, "-c", COLD], check=True, stdout=subprocess.DEVNULL)
        cold.append(time.perf_counter() - began)
    print(f"cold python + import torch + the call: median of 5 {statistics.median(cold) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
