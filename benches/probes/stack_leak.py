"""Whether a call's kwargs are left in the stack of the runtime's children.

Sends three calls with 6 MB of kwargs ending in a secret through
`worker --isolation reset`, then searches the `[stack]` of the worker and
of every child and grandchild for the secret (or it reversed, the reply).
A hit is a leak: a later call in that child could read it.

    python3 benches/probes/stack_leak.py target/release/fluksio-zygote
"""
import json
import os
import re
import subprocess
import sys
import time

SOURCE = "import os\ndef process(sent=None, padding=''):\n    return [os.getpid(), sent[::-1]]\n"


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def stack_hits(pid, pattern):
    try:
        with open(f"/proc/{pid}/maps") as f:
            stack = [line for line in f if line.rstrip().endswith("[stack]")]
        if not stack:
            return []
        start, end = (int(v, 16) for v in stack[0].split()[0].split("-"))
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(start)
            data = mem.read(end - start)
    except OSError:
        return []
    return [end - (start + m.start()) for m in re.finditer(pattern, data)]


def main():
    binary = sys.argv[1]
    env = dict(os.environ, FLUKSIO_RESET_FALLBACK_AFTER="0")
    worker = subprocess.Popen(
        [binary, "worker", "--isolation", "reset"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
    )
    secret = f"reset-secret-6000000-{os.getpid()}"
    for i in range(3):
        request = {"id": i, "op": "run", "flow": "t", "node": "n", "source": SOURCE,
                   "kwargs": {"sent": secret, "padding": "p" * 6_000_000}}
        worker.stdin.write((json.dumps(request, sort_keys=True) + "\n").encode())
        worker.stdin.flush()
        reply = json.loads(worker.stdout.readline())
        assert reply["ok"], reply
    time.sleep(0.3)
    pids = {worker.pid, *children(worker.pid)}
    pids |= {grandchild for child in list(pids) for grandchild in children(child)}
    pattern = re.compile(rb"reset-secret|terces-teser")
    leaks = {pid: stack_hits(pid, pattern) for pid in sorted(pids)}
    worker.stdin.close()
    worker.wait()
    found = {pid: [hex(h) for h in hits] for pid, hits in leaks.items() if hits}
    print(f"{len(pids)} processes searched; the secret in the stack of: "
          f"{found or 'none'} (offsets below the stack's top)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
