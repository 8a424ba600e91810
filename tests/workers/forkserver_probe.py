"""Worker of tests/test_forkserver.py: what a launched rank sees, then an exit.

usage: forkserver_probe.py OUT_PREFIX ACTION
Writes OUT_PREFIX-<RANK or "plain">.json: {"argv", "cwd", "path0", "env": the torchrun variables and
PYTEST_CURRENT_TEST, "threads": torch's intra-op threads, "main": __name__, "exec_rank": the RANK in
/proc/self/environ, the environment the process was exec'd with (None in a fork of the server)}. Then ACTION: "exit:N"
(exit N), "fail-rank:R" (rank R raises, the others sleep until ended), "sleep" (until ended).
"""

import json
import os
import sys
import time

import torch

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID",
        "OMP_NUM_THREADS", "PYTEST_CURRENT_TEST")


def exec_rank() -> str | None:
    for entry in open("/proc/self/environ", "rb").read().split(b"\0"):
        if entry.startswith(b"RANK="):
            return entry[5:].decode()
    return None


def main() -> None:
    prefix, action = sys.argv[1], sys.argv[2]
    rank = os.environ.get("RANK", "plain")
    with open(f"{prefix}-{rank}.json", "w") as f:
        json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "main": __name__,
                   "env": {k: os.environ.get(k) for k in KEYS}, "threads": torch.get_num_threads(),
                   "exec_rank": exec_rank()}, f)
    # each line in one write: the ranks share the job's pipes, and print's text and newline are two writes
    # where the stream is unbuffered, which another rank's line can land between ('probe 0 outprobe 1 out')
    for stream, what in ((sys.stdout, "out"), (sys.stderr, "err")):
        stream.write(f"probe {rank} {what}\n")
        stream.flush()
    kind, _, arg = action.partition(":")
    if kind == "exit":
        sys.exit(int(arg))
    if kind == "fail-rank" and rank == arg:
        raise RuntimeError(f"rank {rank} fails on purpose")
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
