"""How fast a model folder's safetensors files reach tensors a forward can use, in one process, interleaved rounds:

    python -m benchmarks.weight_reads                                   (the 1.1B shape, 3 rounds)
    python -m benchmarks.weight_reads --model models/smollm2-135m-instruct --rounds 5

Each round takes every tensor of every file three ways, all of them kept to the round's end (as a
load keeps them) and every 4 KiB page of each touched once (as the first forward touches them):

* ``read``: :func:`tpengine.model.tensor_file.read_rows` into a new tensor (``torch.empty``: fresh pages,
  faulted and zeroed by the kernel, then the copy from the page cache): a long job's load;
* ``mapped``: :func:`tpengine.model.tensor_file.map_rows` (the page cache's pages themselves): a short
  job's load of its whole weights (:meth:`tpengine.model.loader._Filler.mapped`);
* ``safetensors``: ``safe_open(...).get_slice(name)[...]``, as transformers 5's ``from_pretrained``
  materializes a tensor (a view of the library's mapping).

The files are read once first (the page cache, as a second job finds it). Prints seconds and GB/s per
way and round, the best of each, and the load average (``os.getloadavg``).
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


def touch(t: torch.Tensor) -> None:
    """Read one element of each 4 KiB page of ``t`` (the first forward's page faults)."""
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else t
    if flat.numel():
        flat[::4096].sum()


def read_tpengine(files: list[Path], mapped: bool) -> int:
    """Every tensor of ``files`` by tensor_file, read (or ``mapped``), all kept to the end; the bytes."""
    n, keep = 0, []
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            for info in tensor_file.read_header(path).values():
                if mapped and info.shape:
                    dest = tensor_file.map_rows(fd, info, info.shape[0])
                else:
                    dest = torch.empty(info.shape, dtype=info.dtype)
                    tensor_file.read_rows(fd, info, dest)
                touch(dest)
                keep.append(dest)
                n += info.nbytes
        finally:
            os.close(fd)
    return n


def read_safetensors(files: list[Path]) -> int:
    """Every tensor of ``files`` as transformers' loader materializes it (``safe_open(...).get_slice(name)[...]``),
    all kept to the end; the bytes."""
    from safetensors import safe_open

    keep = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open has no __iter__)
                keep.append(f.get_slice(name)[...])
                touch(keep[-1])
    return sum(t.numel() * t.element_size() for t in keep)


@app.command()
def main(
    model: Annotated[Path, typer.Option(help="a model folder of *.safetensors files")] = Path(
        "models/synth-tinyllama-1.1b"),
    rounds: Annotated[int, typer.Option(help="interleaved rounds")] = 3,
) -> None:
    """Print each way's seconds per round and its best."""
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise typer.BadParameter(f"--model {str(model)!r}: no *.safetensors files there")
    for path in files:  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    ways = {"read": lambda: read_tpengine(files, False), "mapped": lambda: read_tpengine(files, True),
            "safetensors": lambda: read_safetensors(files)}
    best: dict[str, float] = {}
    for r in range(rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            n = way()
            s = time.perf_counter() - start
            best[name] = min(best.get(name, s), s)
            print(f"round {r}: {name:18s} {s:.3f} s  {n / s / 1e9:.2f} GB/s  (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    print("best: " + "; ".join(f"{k} {v:.3f} s" for k, v in best.items()))


if __name__ == "__main__":
    app()
