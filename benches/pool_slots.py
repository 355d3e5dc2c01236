"""The engine's pool with N workers: private zygotes against slots of one
shared zygote (FLUKSIO_SHARED_ZYGOTE=1), side by side in one run.

- memory: total PSS (smaps_rollup, summed over every process of the pool:
  the workers, their zygotes and standby children) of N idle workers that
  have each served a call;
- the next call after a kill: the pool SIGKILLs a worker (a timeout, a
  cancel) and starts another; time from the kill to the new worker's first
  reply. Against the reference worker_main.py, whose node imports the same
  modules at module level (what the pool pays today).

    python3 benches/pool_slots.py [--workers 4] [--preload numpy,pandas,scipy.stats] [--kills 8]

Needs a release build (cargo build --release).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "fluksio-zygote")
REFERENCE = os.path.join(ROOT, "..", "shared", "reference", "fluksio_worker", "worker_main.py")


def tree(pid):
    """pid and every descendant, from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def pss_kib(pid):
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def start(command, env):
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def call(worker, request_id, source):
    request = {"id": request_id, "op": "run", "flow": "bench", "node": "n", "source": source, "kwargs": {}}
    worker.stdin.write(json.dumps(request) + "\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def memory(command, env, workers, source):
    pool = [start(command, env) for _ in range(workers)]
    zygotes = {call(w, i, source)["result"] for i, w in enumerate(pool)}
    time.sleep(1.0)  # standbys set up
    pids = set()
    for worker in pool:
        pids.update(tree(worker.pid))
    for zygote in zygotes:
        pids.update(tree(zygote))
    total = sum(pss_kib(p) for p in pids)
    for worker in pool:
        worker.stdin.close()
        worker.wait()
    return total / 1024, len(pids)


def after_kill(command, env, kills, source):
    keeper = start(command, env)  # another slot of the pool, serving on
    call(keeper, 0, source)
    times = []
    for i in range(kills):
        worker = start(command, env)
        call(worker, 1, source)
        begun = time.perf_counter()
        worker.kill()
        worker.wait()
        worker = start(command, env)
        call(worker, 2, source)
        times.append(time.perf_counter() - begun)
        worker.stdin.close()
        worker.wait()
    keeper.stdin.close()
    keeper.wait()
    return statistics.median(times) * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--preload", default="numpy,pandas,scipy.stats")
    parser.add_argument("--kills", type=int, default=8)
    args = parser.parse_args()
    imports = "import " + ", ".join(args.preload.split(",")) + "\n"
    who = imports + "import os\ndef process():\n    return os.getppid()\n"
    trivial = imports + "def process():\n    return 1\n"
    base = dict(os.environ, FLUKSIO_PRELOAD=args.preload, RUST_LOG="warn")
    # A scope of this run's own: no other run's zygote is shared.
    base["FLUKSIO_BENCH_SCOPE"] = str(time.time())
    private = dict(base)
    shared = dict(base, FLUKSIO_SHARED_ZYGOTE="1")
    ours = [BINARY, "worker"]
    reference = [sys.executable, REFERENCE]

    print(f"{args.workers} workers, preload {args.preload}; python {sys.executable}")
    print()
    print("| pool of workers | processes | total PSS MiB | against private zygotes |")
    print("| --- | ---: | ---: | ---: |")
    private_mib, private_n = memory(ours, private, args.workers, who)
    shared_mib, shared_n = memory(ours, shared, args.workers, who)
    print(f"| private zygote per worker | {private_n} | {private_mib:.1f} | 1.00× |")
    print(f"| slots of one shared zygote | {shared_n} | {shared_mib:.1f} | {shared_mib / private_mib:.2f}× |")
    print()
    print("| next call after a kill (median of %d) | ms | the shared zygote is faster by |" % args.kills)
    print("| --- | ---: | ---: |")
    ref_ms = after_kill(reference, dict(os.environ), args.kills, trivial)
    private_ms = after_kill(ours, private, args.kills, trivial)
    shared_ms = after_kill(ours, shared, args.kills, trivial)
    print(f"| reference `worker_main.py`: cold respawn, node imports {args.preload} | {ref_ms:.1f} | {ref_ms / shared_ms:.0f}× |")
    print(f"| ours, a private zygote per worker: cold respawn, preloads again | {private_ms:.1f} | {private_ms / shared_ms:.0f}× |")
    print(f"| ours, slots of one shared zygote: a new slot, a fork | {shared_ms:.1f} | 1× |")


if __name__ == "__main__":
    main()
