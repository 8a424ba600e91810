"""torchrun worker: load each model folder at this world size and save rank 0's logits.

usage: torchrun --nproc_per_node N tests/workers/tp_logits.py OUT.pt JOBS.json
JOBS.json: [{"key": str, "model_dir": str, "input_ids": [[...]]}, ...]
Rank 0 saves {key: logits [1, T, vocab]} plus per-rank structural audits to OUT.pt.
"""

import json
import sys

import torch

from tpengine.distributed import get_tp, init_distributed, shutdown
from tpengine.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpengine.loader import load_model


def audit(model, plan, rank):
    """Per rank: (linear leaf name, local out, local in) for every parallel linear, plus the
    count of plain nn.Linear left inside decoder layers, plus q_norm weights if any."""
    rows, plain = [], 0
    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            rows.append((name, m.weight.shape[0], m.weight.shape[1]))
        elif isinstance(m, torch.nn.Linear) and ".layers." in name:
            plain += 1
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n}
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return {"linears": rows, "plain_linear": plain, "norms": norms, "tied_storage": tied}


def main():
    out_path, jobs_path = sys.argv[1], sys.argv[2]
    tp = init_distributed(timeout_s=60)
    torch.set_num_threads(1)
    results = {}
    for job in json.load(open(jobs_path)):
        model, plan, _ = load_model(job["model_dir"], tp)
        ids = torch.tensor(job["input_ids"])
        with torch.inference_mode():
            logits = model(ids).logits
        audits = [None] * tp.size
        if tp.size > 1:
            torch.distributed.all_gather_object(audits, audit(model, plan, tp.rank))
        else:
            audits = [audit(model, plan, 0)]
        if tp.is_driver:
            results[job["key"]] = {"logits": logits, "audits": audits}
    if get_tp().is_driver:
        torch.save(results, out_path)
    shutdown()


if __name__ == "__main__":
    main()
