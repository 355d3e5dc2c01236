"""Where a point's time goes when it runs in a child forked per call, for
one workload of `compare --workloads`: BENCHMARKS.md, "Why the smallest
points keep a gap under fork".

    python split.py NODE.py POINTS.jsonl [CALLS]

Runs in one process, one thread per pool (OPENBLAS_NUM_THREADS and
OMP_NUM_THREADS are set to 1 before numpy loads, as a call's share on 2
CPUs with -j 2). For CALLS points (default 30) it measures, as medians:

- warm: the call in this process, after a first call (a reused worker);
- fork: os.fork() in the parent, returning (the kernel copying page
  tables; the child's CPython after-fork work runs in the child);
- exit: the child's _exit and its reaping, seen from the parent;
- the call in a child forked from this process before any call ran
  ("cold") and after one warm-up call ("warmed"): its wall time, its minor
  page faults (copy-on-write and first touch), and its system time;
- first use: what a cold child's call costs beyond a warmed child's (what
  the warm-up catches);
- left over: a warmed child's call beyond the warm call and its faults'
  kernel time (the first-use work the warm-up did not catch).

Prints one JSON object.
"""
import json
import os
import resource
import statistics
import sys
import time

os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"


def load(path):
    directory, name = os.path.split(os.path.abspath(path))
    sys.path.insert(0, directory)
    return __import__(os.path.splitext(name)[0]).process


def in_child(process, kwargs):
    """Calls process(**kwargs) in a forked child; what it cost there."""
    read, write = os.pipe()
    forking = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        process(**kwargs)
        took = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
        os.write(
            write,
            json.dumps(
                {
                    "call": took,
                    "faults": after.ru_minflt - before.ru_minflt,
                    "system": after.ru_stime - before.ru_stime,
                    "after_fork_faults": before.ru_minflt,
                }
            ).encode(),
        )
        os._exit(0)
    forked = time.perf_counter() - forking
    os.close(write)
    report = json.loads(os.read(read, 1 << 16))
    os.close(read)
    exiting = time.perf_counter()
    os.waitpid(pid, 0)
    report["fork"] = forked
    report["exit"] = time.perf_counter() - exiting
    return report


def median(rows, key):
    return statistics.median(row[key] for row in rows)


def mean(rows, key):
    # System time comes in scheduler ticks: a median of it is mostly 0.
    return statistics.fmean(row[key] for row in rows)


def main():
    node, points = sys.argv[1:3]
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    with open(points) as lines:
        points = [json.loads(line) for line in lines if line.strip()][:calls]
    process = load(node)
    import gc

    gc.freeze()
    cold = [in_child(process, kwargs) for kwargs in points]
    process(**points[0])
    gc.freeze()
    warmed = [in_child(process, kwargs) for kwargs in points]
    warm = []
    for kwargs in points:
        start = time.perf_counter()
        process(**kwargs)
        warm.append(time.perf_counter() - start)
    ms = 1e3
    fault_cost = mean(warmed, "system") / max(mean(warmed, "faults"), 1)
    split = {
        "node": os.path.basename(node),
        "calls": len(points),
        "warm_ms": statistics.median(warm) * ms,
        "fork_ms": median(warmed, "fork") * ms,
        "exit_ms": median(warmed, "exit") * ms,
        "cold_child_ms": median(cold, "call") * ms,
        "cold_child_faults": median(cold, "faults"),
        "warmed_child_ms": median(warmed, "call") * ms,
        "warmed_child_faults": median(warmed, "faults"),
        "warmed_child_system_ms": mean(warmed, "system") * ms,
        "after_fork_faults": median(warmed, "after_fork_faults"),
        "fault_us": fault_cost * 1e6,
    }
    split["first_use_ms"] = split["cold_child_ms"] - split["warmed_child_ms"]
    split["left_over_ms"] = (
        split["warmed_child_ms"] - split["warm_ms"] - split["warmed_child_system_ms"]
    )
    print(json.dumps(split))


if __name__ == "__main__":
    main()
