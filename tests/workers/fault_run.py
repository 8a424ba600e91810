"""torchrun worker: the main job (``tpengine.entrypoints.run``) with a fault injected (case C07).

usage: torchrun --nproc_per_node N tests/workers/fault_run.py RANK:STEP [tpengine.entrypoints.run args ...]
Patches ``ModelRunner.execute`` so that rank RANK raises ``RuntimeError("injected fault on
rank R at decode step S")`` at its S-th decode step (1-based), then runs the main job's CLI.
"""

import sys

from tpengine.startup import collector_paused

with collector_paused():  # the start's imports, as the entry points (tpengine/startup.py)
    from tpengine.distributed import get_tp
    from tpengine.engine.model_runner import ModelRunner
    from tpengine.engine.step import StepKind


def inject(rank: int, step: int) -> None:
    execute = ModelRunner.execute
    decode_steps = 0

    def faulty(self, plan, *args, **kwargs):
        nonlocal decode_steps
        if plan.kind == StepKind.DECODE:
            decode_steps += 1
            if (get_tp().rank, decode_steps) == (rank, step):
                raise RuntimeError(f"injected fault on rank {rank} at decode step {step}")
        return execute(self, plan, *args, **kwargs)

    ModelRunner.execute = faulty


def main():
    rank, step = (int(x) for x in sys.argv[1].split(":"))
    inject(rank, step)
    from tpengine.entrypoints.run import app

    app(args=sys.argv[2:], prog_name="tpengine.run")


if __name__ == "__main__":
    main()
