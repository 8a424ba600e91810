"""torchrun worker: tests/workers/engine_generate.py, with each output's logprobs taken from its
sequence (``seq.logprobs``, ``seq.prompt_logprobs``) where the output processor leaves them None.

usage: torchrun --nproc_per_node N tests/workers/sampling_generate.py OUT.json JOBS.json
"""

import sys
from pathlib import Path

from tpengine.engine.output_processor import OutputProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_generate import main  # noqa: E402

_build = OutputProcessor._build


def _build_with_logprobs(seq, *args, **kwargs):
    out = _build(seq, *args, **kwargs)
    if seq.logprobs is not None and out.outputs and out.outputs[0].logprobs is None:
        out.outputs[0].logprobs = list(seq.logprobs)
        out.outputs[0].cumulative_logprob = seq.cumulative_logprob
    if seq.prompt_logprobs is not None and out.prompt_logprobs is None:
        out.prompt_logprobs = [None, *seq.prompt_logprobs]
    return out


OutputProcessor._build = staticmethod(_build_with_logprobs)

if __name__ == "__main__":
    main()
