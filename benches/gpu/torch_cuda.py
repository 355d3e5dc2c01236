"""On a machine with an NVIDIA GPU: CUDA initialised in a call's child of a
torch zygote, and the time to the first CUDA result after a kill, against
the cold path (a fresh python, import torch, the same CUDA work).

    python3 benches/gpu/torch_cuda.py BINARY PYTHON [--calls 20]

BINARY is a fluksio-zygote built against PYTHON's version (for the lent
H200 machine, whose torch lives in Python 3.12: build here with
PYO3_PYTHON=$(pyenv root)/versions/3.12.1/bin/python3 cargo build --release,
carry target/release/fluksio-zygote, and run it there with LD_LIBRARY_PATH
at that Python's libpython). Prints one Markdown table; nothing here runs
in CI.
"""

import argparse
import json
import os
import statistics
import subprocess
import time

NODE = """import os, torch
def process(n):
    started = torch.cuda.is_initialized()
    x = torch.ones(n, n, device="cuda")
    y = (x @ x).sum().item()
    return {"cuda_at_start": started, "result": y, "device": torch.cuda.get_device_name(0)}
"""

COLD = """import torch
x = torch.ones({n}, {n}, device="cuda")
print((x @ x).sum().item())
"""


def request(request_id, n):
    return json.dumps({"id": request_id, "op": "run", "flow": "gpu", "node": "mm", "source": NODE, "kwargs": {"n": n}}) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("python")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--n", type=int, default=1024)
    args = parser.parse_args()
    env = dict(os.environ, RUST_LOG="warn")
    worker = subprocess.Popen(
        [args.binary, "worker", "--python", args.python, "--preload", "torch"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )

    def call(request_id):
        began = time.perf_counter()
        worker.stdin.write(request(request_id, args.n))
        worker.stdin.flush()
        reply = json.loads(worker.stdout.readline())
        return time.perf_counter() - began, reply

    first, reply = call(0)
    assert reply.get("ok"), reply
    assert reply["result"]["cuda_at_start"] is False, "the zygote must not hold a CUDA context"
    per_call = [call(i)[0] for i in range(1, args.calls + 1)]
    # A call killed mid-way (the agent's cancel: SIGKILL to its child), then the next.
    worker.stdin.write(json.dumps({"id": "k", "op": "run", "flow": "gpu", "node": "hang",
                                   "source": "import os, fluksio, time\ndef process():\n    fluksio.emit(pid=os.getpid())\n    time.sleep(600)\n",
                                   "kwargs": {}}) + "\n")
    worker.stdin.flush()
    child = json.loads(worker.stdout.readline())["outputs"]["pid"]
    began = time.perf_counter()
    os.kill(child, 9)
    json.loads(worker.stdout.readline())  # its reply: killed by SIGKILL
    _, after = call(99)
    after_kill = time.perf_counter() - began
    assert after.get("ok"), after
    worker.stdin.close()
    worker.wait()

    cold = []
    for _ in range(3):
        began = time.perf_counter()
        subprocess.run([args.python, "-c", COLD.format(n=args.n)], check=True, stdout=subprocess.DEVNULL)
        cold.append(time.perf_counter() - began)
    cold_ms = statistics.median(cold) * 1000
    rows = [
        ("first call (zygote start, preload torch, compile, CUDA init in the child)", first * 1000),
        (f"per call, CUDA initialised in each child (p50 of {args.calls})", statistics.median(per_call) * 1000),
        ("first CUDA result after a kill (SIGKILL to the call's child)", after_kill * 1000),
        ("cold: python + import torch + the same CUDA work (median of 3)", cold_ms),
    ]
    print(f"device: {reply['result']['device']}; matmul {args.n}×{args.n}")
    print()
    print("| path | ms | cold path is slower by |")
    print("| --- | ---: | ---: |")
    for label, ms in rows:
        print(f"| {label} | {ms:.1f} | {cold_ms / ms:.1f}× |")


if __name__ == "__main__":
    main()
