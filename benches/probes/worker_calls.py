"""Calls of one workload through `fluksio-zygote worker`, back to back, as
the engine's pool sends them: the time a call, and how many calls retired
their resident under `--isolation reset` (said at `info`).

    python3 benches/probes/worker_calls.py BINARY ISOLATION NODE.py [CALLS]

The node's points are `{"seed": i}`; ten calls first, not timed. No thread
variable is inherited: the worker gives its one call every CPU, as it
does for the pool.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

binary, isolation, node = sys.argv[1:4]
calls = int(sys.argv[4]) if len(sys.argv) > 4 else 300
source = open(node).read()
env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
env.update(RUST_LOG="info", FLUKSIO_PRELOAD="numpy")
# Its log to a file: a pipe left unread would fill and stop it.
log = tempfile.TemporaryFile(mode="w+")
worker = subprocess.Popen(
    [binary, "worker", "--isolation", isolation],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=log,
    text=True,
    env=env,
)


def call(i):
    request = {"id": i, "op": "run", "flow": "probe", "node": "probe",
               "source": source, "kwargs": {"seed": i}}
    worker.stdin.write(json.dumps(request) + "\n")
    worker.stdin.flush()
    while True:
        line = json.loads(worker.stdout.readline())
        if line.get("id") == i and "ok" in line:
            assert line["ok"], line
            return


for i in range(10):
    call(i)
started = time.perf_counter()
for i in range(10, 10 + calls):
    call(i)
took = time.perf_counter() - started
worker.stdin.close()
worker.wait()
log.seek(0)
retired = log.read().count("could not be put back")
print(f"{isolation}: {calls} calls in {took:.2f} s, {took / calls * 1000:.2f} ms a call, "
      f"{retired} retired")
