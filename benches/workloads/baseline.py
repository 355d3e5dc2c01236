"""Runs a node's points the way a user would without fluksio-zygote, for
the side-by-side rows of `compare --workloads`.

    python baseline.py METHOD NODE.py POINTS.jsonl OUT.jsonl [JOBS]

METHOD: joblib (joblib.Parallel, its default loky backend), fork or
forkserver (concurrent.futures.ProcessPoolExecutor with that start
method), loop (a for-loop in this process). OUT gets one line per point,
{"index", "result"}, in index order; the loop's lines also have "seconds",
the point's own time in this process (perf_counter around the call alone:
no start-up, no import, no transfer), which is what a point costs.
"""
import concurrent.futures
import importlib.util
import json
import multiprocessing
import os
import sys
import time


def load(path):
    # Importable by name, so that joblib's and forkserver's workers, which
    # unpickle the function by reference, import the same file.
    directory, name = os.path.split(os.path.abspath(path))
    sys.path.insert(0, directory)
    module_name = os.path.splitext(name)[0]
    return getattr(importlib.import_module(module_name), "process")


def call(arguments):
    process, kwargs = arguments
    return process(**kwargs)


def main():
    method, node, points, out = sys.argv[1:5]
    jobs = int(sys.argv[5]) if len(sys.argv) > 5 else os.cpu_count()
    with open(points) as lines:
        points = [json.loads(line) for line in lines if line.strip()]
    process = load(node)
    seconds = None
    if method == "loop":
        results, seconds = [], []
        for kwargs in points:
            start = time.perf_counter()
            results.append(process(**kwargs))
            seconds.append(time.perf_counter() - start)
    elif method == "joblib":
        from joblib import Parallel, delayed

        results = Parallel(n_jobs=jobs)(delayed(process)(**kwargs) for kwargs in points)
    elif method in ("fork", "forkserver"):
        context = multiprocessing.get_context(method)
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            results = list(pool.map(call, [(process, kwargs) for kwargs in points]))
    else:
        sys.exit(f"baseline.py: unknown method {method!r}")
    with open(out, "w") as sink:
        for index, result in enumerate(results):
            line = {"index": index, "result": result}
            if seconds is not None:
                line["seconds"] = seconds[index]
            sink.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
