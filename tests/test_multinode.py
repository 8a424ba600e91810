"""Beyond one machine: two `torchrun --nnodes 2 --nproc_per_node 1` launches (node ranks 0 and
1, rendezvous on 127.0.0.1) give the same logits as one `--nproc_per_node 2` launch."""

from __future__ import annotations

import json
import subprocess

import torch
from conftest import make_tiny_model
from launch import WORKERS, environment, free_port, node_command, popen, torchrun


def test_two_nodes_equal_one_node(tmp_path):
    model = make_tiny_model(tmp_path, "llama", name="tiny", hidden_size=96, num_attention_heads=6)
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([{"key": "a", "model_dir": str(model), "input_ids": [[5, 9, 200, 1000, 7, 3]]}]))
    single = tmp_path / "single.pt"
    torchrun("tp_logits.py", 2, [str(single), str(jobs)])

    port, multi = free_port(), tmp_path / "multi.pt"
    procs = [popen(node_command(WORKERS / "tp_logits.py", [multi, jobs], n, port), env=environment(),
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    a, b = torch.load(single)["a"]["logits"], torch.load(multi)["a"]["logits"]
    assert a.shape == (1, 6, 1001)
    assert torch.equal(a, b)
