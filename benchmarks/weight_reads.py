"""How fast a model folder's safetensors files reach fresh tensors, in one process, interleaved rounds:

    python -m benchmarks.weight_reads                                   (the 1.1B shape, 2 threads, 3 rounds)
    python -m benchmarks.weight_reads --model models/smollm2-135m-instruct --threads 1

Each round reads every tensor of every file into a new tensor of its shape (``torch.empty``: fresh
pages, as a load's parameters are), three ways:

* ``tpengine``: :func:`tpengine.model.tensor_file.read_rows` as a load reads them (large reads split over
  the ``--threads`` torch threads, :func:`tpengine.model.tensor_file._spread`);
* ``tpengine 1 thread``: the same with no split;
* ``safetensors``: each tensor copied out of the file's mapping as transformers 5's ``from_pretrained``
  materializes it (``get_slice(name)[...]``), here on one thread (transformers: a pool of up to 4 workers).

The files are read once first (the page cache, as a second job finds it). Prints seconds and GB/s per
way and round, the best of each, and the load average (``os.getloadavg``). The tensors of one way are
freed before the next.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from tpengine.model import tensor_file

app = typer.Typer(add_completion=False)


def read_tpengine(files: list[Path]) -> int:
    """Read every tensor of ``files`` with tensor_file into fresh tensors, all kept until the end (as a
    load keeps them, so none reuses a freed one's pages); the bytes read."""
    n, keep = 0, []
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            for info in tensor_file.read_header(path).values():
                dest = torch.empty(info.shape, dtype=info.dtype)
                tensor_file.read_rows(fd, info, dest)
                keep.append(dest)
                n += info.nbytes
        finally:
            os.close(fd)
    return n


def read_safetensors(files: list[Path]) -> int:
    """Every tensor of ``files`` as transformers' loader materializes it (``safe_open(...).get_slice(name)[...]``:
    copied out of the file's mapping into a new tensor), one thread, all kept until the end; the bytes read."""
    from safetensors import safe_open

    keep = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            keep += [f.get_slice(name)[...] for name in f.keys()]  # noqa: SIM118 (a safe_open has no __iter__)
    return sum(t.numel() * t.element_size() for t in keep)


@app.command()
def main(
    model: Annotated[Path, typer.Option(help="a model folder of *.safetensors files")] = Path(
        "models/synth-tinyllama-1.1b"),
    threads: Annotated[int, typer.Option(help="torch threads (a tp=1 job's default: the CPUs it may use)")] = 2,
    rounds: Annotated[int, typer.Option(help="interleaved rounds")] = 3,
) -> None:
    """Print each way's seconds per round and its best."""
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise typer.BadParameter(f"--model {str(model)!r}: no *.safetensors files there")
    torch.set_num_threads(threads)
    for path in files:  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    split = tensor_file.SPLIT_BYTES
    ways = {"tpengine": lambda: read_tpengine(files), "tpengine 1 thread": lambda: read_tpengine(files),
            "safetensors": lambda: read_safetensors(files)}
    best: dict[str, float] = {}
    for r in range(rounds):
        for name, way in ways.items():
            tensor_file.SPLIT_BYTES = 1 << 62 if name == "tpengine 1 thread" else split
            start = time.perf_counter()
            n = way()
            s = time.perf_counter() - start
            best[name] = min(best.get(name, s), s)
            print(f"round {r}: {name:18s} {s:.3f} s  {n / s / 1e9:.2f} GB/s  (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    tensor_file.SPLIT_BYTES = split
    print("best: " + "; ".join(f"{k} {v:.3f} s" for k, v in best.items()) + f" ({threads} threads)")


if __name__ == "__main__":
    app()
