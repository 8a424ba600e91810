"""torchrun worker: load each model folder at this world size through the engine's ModelRunner
(the production model path: fused layers, packed CPU weights, paged attention over the KV cache)
and save rank 0's logits of one prefill step at every position.

usage: torchrun --nproc_per_node N tests/workers/tp_logits.py OUT.pt JOBS.json
JOBS.json: [{"key": str, "model_dir": str, "input_ids": [[...]]}, ...]
Rank 0 saves {key: {"logits": [1, T, vocab], "audits": [per rank]}} to OUT.pt.
"""

import json
import sys

from tpengine.startup import collector_paused

with collector_paused():  # the start's imports, as the entry points (tpengine/startup.py)
    import torch

    from tpengine.config import EngineConfig
    from tpengine.distributed import get_tp, init_distributed, shutdown
    from tpengine.engine.model_runner import ModelRunner
    from tpengine.engine.step import StepKind, StepPlan
    from tpengine.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

BLOCK = 16


def audit(model, weight_bytes: int, profile):
    """Per rank: (linear name, local out, local in) for every parallel linear (each part of a merged
    q/k/v or gate/up layer under its checkpoint leaf name), the count of plain nn.Linear left
    inside decoder layers, q_norm/k_norm weights if any, whether the LM head shares the
    embedding's storage, the weight bytes the rank holds, and how many linears still hold a plain
    weight beside (or instead of) their packed layout."""
    rows, plain = [], 0
    for name, m in model.named_modules():
        if isinstance(m, MergedColumnParallelLinear):
            prefix = name.rsplit(".", 1)[0]
            rows += [(f"{prefix}.{p}", n, m.in_features) for p, n in zip(m.part_names, m.sizes)]
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            rows.append((name, m.out_features, m.in_features))
        elif isinstance(m, torch.nn.Linear) and ".layers." in name:
            plain += 1
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n}
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    # one storage: the same plain tensor, or the head's blocked layout only, which the embedding's lookup reads
    # (the CPU platform's blocked tied head: both plain weights None)
    tied = (head.weight is not None and emb.weight is not None and head.weight.data_ptr() == emb.weight.data_ptr()) \
        or (head.weight is None and emb.weight is None and getattr(head, "packed", None) is not None
            and getattr(emb, "lookup", None) is not None)
    layers = [m for m in model.modules() if isinstance(m, (MergedColumnParallelLinear, RowParallelLinear,
                                                           ColumnParallelLinear))]
    return {"linears": rows, "plain_linear": plain, "norms": norms, "tied_storage": tied, "weight_bytes": weight_bytes,
            "unpacked": sum(m.weight is not None for m in layers),
            "plain_chosen": sum(profile.linear_layouts[(m.out_features, m.in_features)].layout == "plain"
                                for m in layers),
            "packed_and_plain": sum(m.weight is not None and m.packed is not None for m in layers)}


def prefill_plan(ids: torch.Tensor) -> StepPlan:
    """One sequence of T tokens from position 0, logits at every position."""
    t = ids.numel()
    nblocks = -(-t // BLOCK)
    return StepPlan(StepKind.PREFILL, input_ids=ids, positions=torch.arange(t), slot_mapping=torch.arange(t),
                    block_tables=torch.arange(nblocks)[None], cu_seqlens_q=torch.tensor([0, t]),
                    cu_seqlens_k=torch.tensor([0, t]), context_lens=torch.tensor([t]), sample_idx=torch.arange(t))


def main():
    out_path, jobs_path = sys.argv[1], sys.argv[2]
    tp = init_distributed(timeout_s=60)
    torch.set_num_threads(1)
    results = {}
    for job in json.load(open(jobs_path)):
        ids = torch.tensor(job["input_ids"])[0]
        config = EngineConfig(model=job["model_dir"], dtype=job.get("dtype", "float32"), max_model_len=ids.numel() + 1,
                              block_size=BLOCK, num_kv_blocks=-(-ids.numel() // BLOCK))
        runner = ModelRunner(config, tp)
        logits = runner.execute(prefill_plan(ids))
        audits = [None] * tp.size
        if tp.size > 1:
            torch.distributed.all_gather_object(audits, audit(runner.model, runner.weight_bytes, runner.profile))
        else:
            audits = [audit(runner.model, runner.weight_bytes, runner.profile)]
        if tp.is_driver:
            results[job["key"]] = {"logits": logits[None], "audits": audits}
        del runner
    if get_tp().is_driver:
        torch.save(results, out_path)
    shutdown()


if __name__ == "__main__":
    main()
