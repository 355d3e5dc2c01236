"""The engine's own PythonWorkerPool, with fluksio-zygote as its interpreter.

Run by tests/pool.rs: python3 tests/pool_dropin.py BINARY REFERENCE_DIR. The
pool is the reference reconstruction in ../shared/reference, imported as is;
it spawns ``[BINARY, .../worker_main.py]``, which the binary serves as
``fluksio-zygote worker``. Prints one line per check; exits 1 if any failed.
"""

import os
import sys
import tempfile
import threading
import time

BINARY, REFERENCE = sys.argv[1], sys.argv[2]
sys.path.insert(0, REFERENCE)

from fluksio.flow.events import EventBus  # noqa: E402
from fluksio.flow.workers import (  # noqa: E402
    NodeCancelled,
    NodeTimeout,
    PythonWorkerPool,
    RemoteError,
)

FAILED = []


# Slots of one shared zygote (FLUKSIO_SHARED_ZYGOTE): a killed slot's call
# dies, the zygote the slots share does not.
SHARED = os.environ.get("FLUKSIO_SHARED_ZYGOTE", "") not in ("", "0")


def check(name, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"), flush=True)
    if not ok:
        FAILED.append(name)


def gone(pid, limit=10.0):
    """No such process, or a zombie nobody has reaped yet."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            # Gone, or gone between the open and the read.
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.02)
    return False


SLEEPER = """
import fluksio, os, subprocess, time
def process(seconds):
    sleeper = subprocess.Popen(['sleep', '3600'])
    fluksio.emit(pids=[os.getpid(), sleeper.pid, os.getppid()])
    time.sleep(seconds)
    return 'woke'
"""


def started(seen):
    """Waits for the sleeper's emit; returns [call pid, grandchild, zygote]."""
    for _ in range(1000):
        if seen:
            return seen[0]["outputs"]["pids"]
        time.sleep(0.01)
    raise AssertionError("the node never reported its pids")


def main():
    artifacts = tempfile.mkdtemp(prefix="fz-pool-artifacts-")
    events = EventBus()
    pool = PythonWorkerPool(BINARY, size=2, events=events, env={"FLUKSIO_ARTIFACT_DIR": artifacts})
    pool.start()
    try:
        double = "def process(x):\n    return x * 2\n"
        check("compile ok", pool.compile("f", "double", double) is None)
        short = pool.compile("f", "bad", "def process(:\n")
        check("compile error: the short line", short == "SyntaxError: invalid syntax (line 1)", repr(short))
        check("compile keep=False", pool.compile("f", "double", "def process():\n    return 0\n", keep=False) is None)
        check("run returns the value", pool.run("f", "double", double, {"x": 21}, "f.double", timeout=10) == 42)

        seen = []
        gen = "def process(n):\n    for i in range(n):\n        yield {'out': i}\n    return {'out': 'done'}\n"
        value = pool.run("f", "gen", gen, {"n": 4}, "f.gen", timeout=10, run_id="r0", on_event=seen.append)
        check(
            "generator events through on_event",
            value == {"out": "done"}
            and [e["outputs"]["out"] for e in seen] == [0, 1, 2, 3]
            and all(e["event"] == "yield" and e["call_id"] == "r0:f.gen" for e in seen),
            repr((value, seen)),
        )

        try:
            pool.run("f", "boom", "def process():\n    raise KeyError('k')\n", {}, "f.boom", 10)
            check("node error re-raised under its own class name", False, "no exception")
        except RemoteError as exc:
            check(
                "node error re-raised under its own class name",
                type(exc).__name__ == "KeyError" and "<node f.boom>" in exc.remote_traceback,
                f"{type(exc).__name__}: {exc}",
            )

        crashed = "import os\ndef process():\n    os._exit(3)\n"
        try:
            pool.run("f", "crash", crashed, {}, "f.crash", 10)
            check("a crash is one call's error", False, "no exception")
        except RemoteError as exc:
            check("a crash is one call's error", "exited with code 3" in str(exc), str(exc))
        check("the worker survives a crash", pool.run("f", "double", double, {"x": 1}, "f.double", 10) == 2)

        seen = []
        t0 = time.monotonic()
        try:
            pool.run("f", "sleep", SLEEPER, {"seconds": 30}, "f.sleep", timeout=1.0, on_event=seen.append)
            check("timeout -> NodeTimeout", False, "no exception")
        except NodeTimeout:
            check("timeout -> NodeTimeout", time.monotonic() - t0 < 15)
        call, grandchild, zygote = started(seen)
        check("timeout: the killed worker's call is gone", gone(call), call)
        check("timeout: and what the call started", gone(grandchild), grandchild)
        if SHARED:
            check("timeout: the shared zygote serves the other slots on", not gone(zygote, 1.0), zygote)
        else:
            check("timeout: and the worker", gone(zygote), zygote)

        seen = []
        outcome = {}

        def victim():
            try:
                outcome["value"] = pool.run(
                    "f", "sleep", SLEEPER, {"seconds": 30}, "f.sleep", timeout=0, run_id="r1", on_event=seen.append
                )
            except BaseException as exc:  # noqa: BLE001
                outcome["exc"] = exc

        thread = threading.Thread(target=victim)
        thread.start()
        call, grandchild, zygote = started(seen)
        cancelled = pool.cancel("f.sleep", run_id="r1")
        thread.join(timeout=15)
        check("cancel -> NodeCancelled", cancelled is True and isinstance(outcome.get("exc"), NodeCancelled), repr(outcome))
        check("cancel: the call's process is gone", gone(call), call)
        check("cancel: and what it started", gone(grandchild), grandchild)
        if SHARED:
            check("cancel: the shared zygote serves the other slots on", not gone(zygote, 1.0), zygote)
        else:
            check("cancel: and the worker", gone(zygote), zygote)
        check("cancel of nothing -> False", pool.cancel("f.nothing", run_id="r1") is False)

        counter = "seen = []\ndef process():\n    seen.append(1)\n    return len(seen)\n"
        counts = [pool.run("f", "counter", counter, {}, "f.counter", 10) for _ in range(6)]
        if os.environ.get("FLUKSIO_ISOLATION") == "node":
            check("isolation node: module state kept, as a reused worker_main.py", max(counts) >= 2, repr(counts))
        else:
            check("isolation call: every call from the zygote's state", counts == [1] * 6, repr(counts))

        parent = "import os\ndef process():\n    return os.getppid()\n"
        before = {pool.run("f", "parent", parent, {}, "f.parent", 10) for _ in range(4)}
        pool.respawn_all()
        after = {pool.run("f", "parent", parent, {}, "f.parent", 10) for _ in range(4)}
        if SHARED:
            # The slots are replaced; the zygote they share may outlive them.
            check("respawn_all: the new slots serve", len(after) == 1, repr((before, after)))
        else:
            check("respawn_all replaces the workers", before and after and not (before & after), repr((before, after)))
            check("respawned workers are gone", all(gone(pid) for pid in before), repr(before))
    finally:
        pool.stop()
    try:
        pool.run("f", "double", "def process(x):\n    return x\n", {"x": 1}, "f.double", 10)
        check("stop(): later calls refused", False, "no exception")
    except RemoteError as exc:
        check("stop(): later calls refused", "shutting down" in str(exc), str(exc))
    check("stop(): worker processes gone", all(gone(pid) for pid in after), repr(after))
    print(f"{'FAILED: ' + ', '.join(FAILED) if FAILED else 'all passed'}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
