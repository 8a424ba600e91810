"""torchrun worker: does :func:`tpengine.distributed.shutdown` release the process group?

usage: torchrun --nproc_per_node N tests/workers/shutdown_check.py MODEL_DIR OUT_PREFIX
Each rank loads MODEL_DIR (which imports transformers' modeling code, and through it
torch.distributed.nn), runs one collective, shuts down, and writes OUT_PREFIX-<rank>.json:
{"group_alive": the default ProcessGroup object still exists, "threads_before": threads before
init_distributed, "threads_after": threads after shutdown}. A group kept alive past shutdown keeps
gloo's worker threads running into interpreter finalization, where they can abort the process.
"""

import gc
import json
import os
import sys
import weakref

import torch.distributed as dist

from tpengine.distributed import init_distributed, shutdown
from tpengine.model.loader import load_model


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main():
    model_dir, prefix = sys.argv[1], sys.argv[2]
    before = threads()
    tp = init_distributed(timeout_s=60)
    group = weakref.ref(dist.distributed_c10d._get_default_group())
    load_model(model_dir, tp)
    gathered = [None] * tp.size
    dist.all_gather_object(gathered, tp.rank)
    shutdown()
    gc.collect()
    result = {"group_alive": group() is not None, "threads_before": before, "threads_after": threads(),
              "gathered": gathered}
    with open(f"{prefix}-{tp.rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
