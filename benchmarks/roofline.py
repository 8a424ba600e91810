"""The roofline of a benchmark run: the machine's limits, measured once per run, and how close each row
comes to them (``make bench``, ``make bench-peers``; issue 59).

    python -m benchmarks.roofline                      (the machine's limits at make bench's shapes)

The limits (:func:`measure_roofline`, before any worker starts):

* **memory bandwidth**: a STREAM-style triad ``a = b + 3 c`` (McCalpin's STREAM; torch's ``add`` with
  ``alpha``) over float32 arrays of :data:`TRIAD_MIB` MiB each (far past the last-level cache), counted
  as STREAM counts it (3 arrays x 4 bytes an element: two read, one written; write-allocate not counted). The
  bench's rows run as one process with all cores (tp=1, the peers) or as ``tp`` processes of cores / tp
  threads (torchrun's ranks), so the triad runs in each of those layouts (:data:`MARK` protocol
  workers, :func:`triad_bandwidths`): the processes start their loops at one instant and each one's
  fastest pass inside a common window counts; the layout's bandwidth is their sum.
* **the GEMM rate** per dtype (:func:`gemm_rate`): ``torch.matmul`` ``[M, hidden] x [hidden,
  intermediate]`` in float32 and bfloat16, and ``torch._int_mm`` (int8 x int8 -> int32) for int8,
  with all cores' threads, at M = the throughput workload's decode batch (its number of prompts) and
  its prefill rows (capped at :data:`GEMM_MAX_ROWS`); the faster is the ceiling, in GFLOP/s.

Per row (:func:`row_limits`):

* ``floor_ms``: the weight-bandwidth floor of a batch-1 decode step = the bytes it must read
  (:func:`decode_bytes`: every weight matrix in the row's precision with its scales and zero codes,
  the LM head in full (a tied embedding counted once), norms and biases, one embedding row when
  untied, a mixture of experts' active share, the KV cache at the latency workload's mean context) /
  the layout's triad bandwidth; ``tpot_vs_floor`` = TPOT / floor (1.0: at the floor);
* ``flops_fraction``: the throughput workload's matmul rate, 2 x matmul parameters a token (the
  linears and the head; attention's own products left out) x (prompt + output) tokens/s, over the
  GEMM rate of the row's arithmetic (:attr:`Precision.compute`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable

import typer

MARK = "@@bench "  # the worker protocol of benchmarks.bench_worker (one JSON answer a line)
#: MiB of each triad array (3 of them): STREAM's rule, each array 4x the caches (32 MiB of L3 here).
TRIAD_MIB = 128
#: Seconds of each layout's triad window (each process's fastest pass inside it counts).
TRIAD_WINDOW_S = 1.0
#: Seconds each GEMM shape is timed (the fastest call counts).
GEMM_WINDOW_S = 0.3
#: The largest M of the prefill-shaped GEMM (8192 rows would take seconds per dtype).
GEMM_MAX_ROWS = 2048
#: The GEMM dtypes measured: the rows' arithmetic (:attr:`Precision.compute`).
GEMM_DTYPES = ("float32", "bfloat16", "int8")
#: Bytes of an element of each float dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a figure of a tiny test model stays nonzero)."""
    return float(f"{x:.4g}")


@dataclass(frozen=True)
class WeightFormat:
    """How a ``[rows, cols]`` weight matrix is held: ``bits`` a weight, plus ``scale_bytes`` (scale and
    zero code together) per ``group`` consecutive inputs of a row (``group`` 0: one per row), the rows
    padded to a multiple of ``row_multiple``."""

    bits: int
    group: int = 0
    scale_bytes: int = 0
    row_multiple: int = 1

    def nbytes(self, rows: int, cols: int) -> int:
        """Bytes of a ``[rows, cols]`` matrix in this format (rows of a whole number of bytes)."""
        groups = 1 if self.group == 0 else -(-cols // self.group)
        rows = -(-rows // self.row_multiple) * self.row_multiple
        return rows * (-(-cols * self.bits // 8) + groups * self.scale_bytes)


@dataclass(frozen=True)
class Precision:
    """How one row holds the model: its ``linear`` and ``head`` (and embedding) :class:`WeightFormat`,
    ``act_bytes`` (norms, biases, an embedding row: the activations' dtype), ``kv_bytes`` (an element
    of the KV cache) and ``compute``, the dtype of its arithmetic (a key of the roofline's ``gemm``)."""

    linear: WeightFormat
    head: WeightFormat
    act_bytes: int
    kv_bytes: int
    compute: str


def float_precision(dtype: str) -> Precision:
    """Every weight, activation and KV element in ``dtype`` ("float32", "bfloat16").

    Raises:
        ValueError: ``dtype`` not in :data:`DTYPE_BYTES`.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    b = DTYPE_BYTES[dtype]
    fmt = WeightFormat(8 * b)
    return Precision(fmt, fmt, b, b, dtype)


def tpengine_precision(dtype: str, quantization: str | None) -> Precision:
    """tpengine's weights with ``--dtype dtype --quantization quantization`` (None: float), as the
    engine holds them (:class:`tpengine.model.quant.weights.QuantScheme`, docs/notes/quant-format.md):
    int8 per output channel or group, a scale in ``dtype``; int4 at its group size, a scale in
    ``dtype`` and a one-byte zero code (or a zero in ``dtype``), its rows padded to a multiple of
    ``INT4_ROW_MULTIPLE`` (torch's packed layout); the head by the scheme's ``vocab``;
    the arithmetic in ``dtype`` (quantized weights are widened), the KV cache in ``dtype``.

    Raises:
        ValueError: an unknown dtype or quantization.
    """
    base = float_precision(dtype)
    if not quantization:
        return base
    from tpengine.model.quant.arith import INT4_ROW_MULTIPLE
    from tpengine.model.quant.weights import QuantScheme

    def fmt(s) -> WeightFormat:
        if s is None:
            return base.linear
        if s.name == "int8":
            return WeightFormat(8, s.group_size or 0, base.act_bytes)
        return WeightFormat(4, s.group_size, base.act_bytes + (1 if s.zero_codes else base.act_bytes),
                            INT4_ROW_MULTIPLE)

    scheme = QuantScheme.of(quantization)
    return Precision(fmt(scheme), fmt(scheme.vocab), base.act_bytes, base.kv_bytes, dtype)


def ct2_precision(compute_type: str) -> Precision:
    """CTranslate2's ``compute_type`` on CPU: float32, or int8 = every 2-D weight (its embeddings and
    output projection too: ``Model::is_quantizable``) int8 with a float32 scale per row, float32
    activations and KV, int8 GEMMs.

    Raises:
        ValueError: another compute type.
    """
    if compute_type == "float32":
        return float_precision("float32")
    if compute_type == "int8":
        fmt = WeightFormat(8, 0, 4)
        return Precision(fmt, fmt, 4, 4, "int8")
    raise ValueError(f"compute_type {compute_type!r} is not one of float32, int8")


@dataclass(frozen=True)
class ModelTensors:
    """A model's weights by role, from its HF config (:func:`model_tensors`): ``linears`` ``(rows,
    cols, count)`` (count matrices of ``[rows, cols]``), ``experts`` the same for a mixture of
    experts' matrices, ``expert_share`` the share of them one token reads (top-k / experts), ``head``
    ``(vocab, hidden)``, ``tied`` (the embedding is the head), ``vector_params`` (norms and biases)
    and ``kv_per_token`` (K and V elements of every layer a token adds to the cache)."""

    linears: tuple[tuple[int, int, int], ...]
    experts: tuple[tuple[int, int, int], ...]
    expert_share: float
    head: tuple[int, int]
    tied: bool
    vector_params: int
    kv_per_token: int

    @property
    def hidden(self) -> int:
        """The hidden size (the head's input features)."""
        return self.head[1]


def model_tensors(hf_config) -> ModelTensors:
    """The :class:`ModelTensors` of ``hf_config`` (a transformers ``PretrainedConfig``): the causal LM
    built on the meta device (shapes only, no weights read); 3-D parameters are experts ``[E, rows,
    cols]``; K and V per token from ``num_key_value_heads`` (else the attention heads) x ``head_dim``
    (else hidden / heads) x 2 x the layers (every layer counted, sliding windows or not)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    linears: dict[tuple[int, int], int] = {}
    experts: dict[tuple[int, int], int] = {}
    vectors = 0
    for p in model.parameters():  # a tied weight once
        if p is emb or p is head:
            continue
        if p.dim() == 2:
            linears[tuple(p.shape)] = linears.get(tuple(p.shape), 0) + 1
        elif p.dim() == 3:
            experts[tuple(p.shape[1:])] = experts.get(tuple(p.shape[1:]), 0) + p.shape[0]
        else:
            vectors += p.numel()
    text = hf_config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    n_experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    share = top_k / n_experts if experts and n_experts and top_k else 1.0
    return ModelTensors(tuple((r, c, n) for (r, c), n in linears.items()),
                        tuple((r, c, n) for (r, c), n in experts.items()), share, tuple(head.shape),
                        emb is head, vectors, 2 * text.num_hidden_layers * kv_heads * head_dim)


def weight_bytes(t: ModelTensors, p: Precision) -> int:
    """Bytes of every weight held in precision ``p``: the linears and experts, the head, an untied
    embedding in the head's format, norms and biases (the engine's ``ModelRunner.weight_bytes`` at
    tp=1)."""
    mats = sum(p.linear.nbytes(r, c) * n for r, c, n in t.linears + t.experts)
    return mats + p.head.nbytes(*t.head) * (1 if t.tied else 2) + t.vector_params * p.act_bytes


def decode_bytes(t: ModelTensors, p: Precision, context: float) -> int:
    """Bytes a batch-1 decode step reads in precision ``p`` at ``context`` cached tokens: every linear,
    the experts' active share, the head in full, one embedding row when untied, norms and biases, and
    the KV cache (``kv_per_token`` x ``context`` elements)."""
    mats = sum(p.linear.nbytes(r, c) * n for r, c, n in t.linears)
    mats += sum(p.linear.nbytes(r, c) * n for r, c, n in t.experts) * t.expert_share
    embedding_row = 0 if t.tied else t.hidden * p.act_bytes
    kv = t.kv_per_token * context * p.kv_bytes
    return round(mats + p.head.nbytes(*t.head) + embedding_row + t.vector_params * p.act_bytes + kv)


def gguf_decode_bytes(path: str | Path, t: ModelTensors, context: float, kv_bytes: int = 2) -> int:
    """:func:`decode_bytes` of llama.cpp's GGUF file ``path``, from its tensor table (each tensor's
    bytes as stored: Q4_1 blocks of 32 weights in 20 bytes, Q8_0 in 34, ...): every tensor, the
    3-D expert tensors at ``t.expert_share``, ``token_embd.weight`` one row when an
    ``output.weight`` exists (else it is the head, read in full), plus the KV cache in ``kv_bytes``
    (llama.cpp's default f16) at ``context`` tokens of ``t``."""
    from shard_tool.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    untied = "output.weight" in tensors
    total = 0.0
    for name, x in tensors.items():
        n = x.data.nbytes
        if name == "token_embd.weight" and untied:
            n = n // x.shape[0]
        total += n * (t.expert_share if len(x.shape) == 3 else 1)
    return round(total + t.kv_per_token * context * kv_bytes)


def matmul_params(t: ModelTensors) -> float:
    """Weights one token multiplies by: the linears, the experts' active share and the head."""
    return (sum(r * c * n for r, c, n in t.linears) + sum(r * c * n for r, c, n in t.experts) * t.expert_share
            + t.head[0] * t.head[1])


def row_limits(tpot_ms: float | None, tok_s: float | None, nbytes: float, bandwidth_gb_s: float | None,
               params: float, gemm_gflop_s: float | None) -> dict:
    """A row's distance from the roofline: ``floor_bytes`` (``nbytes``, what a decode step reads),
    ``floor_ms`` = ``nbytes`` / the bandwidth (GB/s), ``tpot_vs_floor`` = ``tpot_ms`` / ``floor_ms``,
    ``flops_fraction`` = 2 x ``params`` x ``tok_s`` (tokens a second through the linears) / the GEMM
    rate (GFLOP/s); a figure is left out when what it needs is None (floor and fraction to 4
    significant digits, the ratio to 2 decimals)."""
    out: dict = {"floor_bytes": int(nbytes)}
    if bandwidth_gb_s:
        floor_ms = nbytes / (bandwidth_gb_s * 1e9) * 1e3
        out["floor_ms"] = _sig(floor_ms)
        if tpot_ms is not None:
            out["tpot_vs_floor"] = round(tpot_ms / floor_ms, 2)
    if tok_s is not None and gemm_gflop_s:
        out["flops_fraction"] = _sig(2 * params * tok_s / (gemm_gflop_s * 1e9))
    return out


def mean_context(latency_input_len: int, latency_output_len: int) -> float:
    """The mean cached tokens over the latency workload's decode steps (TPOT's steps): the prompt
    plus half the output."""
    return latency_input_len + latency_output_len / 2


def bandwidth_of(roofline: dict, procs: int, threads: int) -> float | None:
    """The triad GB/s of ``procs`` processes x ``threads`` threads in ``roofline`` (None: not
    measured)."""
    for b in roofline.get("bandwidth", []):
        if b["procs"] == procs and b["threads"] == threads:
            return b["gb_s"]
    return None


def gemm_of(roofline: dict, dtype: str) -> float | None:
    """The GEMM ceiling (GFLOP/s) of ``dtype`` in ``roofline`` (None: not measured)."""
    return (roofline.get("gemm", {}).get(dtype) or {}).get("gflop_s")


def annotate(row: dict, roofline: dict, t: ModelTensors, nbytes: float, compute: str, procs: int,
             threads: int) -> None:
    """Add :func:`row_limits` to ``row`` (a summary row with ``tpot_ms`` and, with a throughput run,
    ``total_tok_s``): a decode step of ``nbytes`` (:func:`decode_bytes`) against the triad of ``procs``
    x ``threads``, the model ``t``'s matmuls against the GEMM rate of ``compute``."""
    row.update(row_limits(row.get("tpot_ms"), row.get("total_tok_s"), nbytes, bandwidth_of(roofline, procs, threads),
                          matmul_params(t), gemm_of(roofline, compute)))


def limits_cells(row: dict) -> tuple[str, str, str]:
    """The table cells of a row's limits: floor ms, TPOT / floor, FLOPs of the ceiling (``-`` where
    missing)."""
    floor = f"{row['floor_ms']:.2f}" if "floor_ms" in row else "-"
    vs = f"{row['tpot_vs_floor']:.2f}x" if "tpot_vs_floor" in row else "-"
    flops = f"{row['flops_fraction']:.1%}" if "flops_fraction" in row else "-"
    return floor, vs, flops


def roofline_text(roofline: dict) -> str:
    """One line of the measured limits: ``triad 26.6 GB/s (1 x 2 threads), 25.1 GB/s (2 x 1); GEMM
    GFLOP/s float32 150, bfloat16 300, int8 -`` and, where recorded, `` (load average 0.4)``."""
    bw = ", ".join(f"{b['gb_s']:.1f} GB/s ({b['procs']} x {b['threads']} threads)" for b in roofline["bandwidth"])
    gemm = ", ".join(f"{d} {g['gflop_s']:.0f}" if g else f"{d} -" for d, g in roofline["gemm"].items())
    load = f" (load average {roofline['load_avg']:.1f})" if roofline.get("load_avg") is not None else ""
    return f"roofline: triad {bw}; GEMM GFLOP/s {gemm}{load}"


# ------------------------------------------------------------------------------------ measuring
def gemm_rate(dtype: str, m: int, k: int, n: int, window_s: float) -> float | None:
    """GFLOP/s (2 m k n a call) of the fastest ``[m, k] x [k, n]`` product in ``window_s`` seconds
    (at least 3 calls) with the current threads: ``torch.matmul`` for a float dtype (weight
    ``[n, k]`` transposed, as ``F.linear``), ``torch._int_mm`` for "int8"; None where torch has no
    int8 product on this CPU."""
    import torch

    if dtype == "int8":
        a = torch.randint(-8, 8, (m, k), dtype=torch.int8)
        b = torch.randint(-8, 8, (k, n), dtype=torch.int8)
        call = lambda: torch._int_mm(a, b)  # noqa: E731
        try:
            call()
        except (AttributeError, RuntimeError, NotImplementedError):
            return None
    else:
        a = torch.randn(m, k, dtype=getattr(torch, dtype))
        w = torch.randn(n, k, dtype=getattr(torch, dtype))
        call = lambda: torch.matmul(a, w.t())  # noqa: E731
    call()
    best, calls, t_end = math.inf, 0, time.perf_counter() + window_s
    while calls < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        call()
        best, calls = min(best, time.perf_counter() - t0), calls + 1
    return 2 * m * k * n / best / 1e9


def gemm_rates(shapes: list[tuple[int, int, int]], threads: int, window_s: float) -> dict:
    """``{dtype: {"gflop_s": the best, "by_shape": {"MxKxN": GFLOP/s}}}`` (None for a dtype without a
    product) of :data:`GEMM_DTYPES` at ``shapes`` with ``threads`` intra-op threads (restored
    after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out: dict = {}
        for dtype in GEMM_DTYPES:
            by = {f"{m}x{k}x{n}": gemm_rate(dtype, m, k, n, window_s) for m, k, n in shapes}
            rates = [r for r in by.values() if r is not None]
            out[dtype] = {"gflop_s": _sig(max(rates)),
                          "by_shape": {s: _sig(r) for s, r in by.items() if r is not None}} if rates else None
        return out
    finally:
        torch.set_num_threads(before)


def triad_arrays(threads: int, mib: int) -> tuple:
    """This process's triad arrays ``(a, b, c)``, float32, ``mib`` MiB each, every page touched, and
    ``threads`` intra-op threads set."""
    import torch

    torch.set_num_threads(threads)
    n = mib * 2**20 // 4
    a, b, c = torch.empty(n), torch.full((n,), 1.0), torch.full((n,), 2.0)
    torch.add(b, c, alpha=3.0, out=a)
    return a, b, c


def triad_best(arrays: tuple, start: float, window_s: float) -> dict:
    """The triad ``a = b + 3 c`` over :func:`triad_arrays`: sleep until ``start`` (``time.monotonic``,
    shared by the processes of a layout), loop until ``window_s`` and a tenth past it (so the others'
    last passes still overlap), and return ``{"gb_s"}`` of the fastest pass inside ``[start, start +
    window_s]`` (the first pass when none fits; 3 x 4 bytes an element) and ``{"passes"}`` inside."""
    import torch

    a, b, c = arrays
    time.sleep(max(0.0, start - time.monotonic()))
    end, best, first, passes = start + window_s, math.inf, None, 0
    while True:
        t0 = time.monotonic()
        torch.add(b, c, alpha=3.0, out=a)
        t1 = time.monotonic()
        first = t1 - t0 if first is None else first
        if t1 <= end:
            best, passes = min(best, t1 - t0), passes + 1
        if t1 > end + window_s / 10:
            break
    return {"gb_s": 3 * a.nbytes / (best if passes else first) / 1e9, "passes": passes}


def triad_bandwidths(layouts: list[tuple[int, int]], logdir: Path, mib: int, window_s: float) -> list[dict]:
    """``[{"procs", "threads", "gb_s"}]``: the triad's GB/s in each ``(procs, threads)`` layout, its
    ``procs`` worker processes of ``threads`` threads each (three arrays of ``mib`` MiB each) started
    together for ``window_s`` (the sum of each one's :func:`triad_best`), one layout after the other
    (every worker started and its arrays made first, so one start-up serves all; an idle worker
    waits on its stdin); workers started like the bench's (:func:`benchmarks.launcher`), stderr in
    ``logdir``.

    Raises:
        RuntimeError: a worker died (with its log's tail).
    """
    from benchmarks.bench import Worker

    groups: dict[tuple[int, int], list[Worker]] = {}
    try:
        for procs, threads in dict.fromkeys(layouts):
            groups[procs, threads] = [
                Worker(f"triad{procs}x{threads}-{i}", ["--triad-worker", "--threads", str(threads), "--mib", str(mib)],
                       1, logdir / f"triad-{procs}x{threads}-{i}.log", module="benchmarks.roofline")
                for i in range(procs)]
        for w in [w for ws in groups.values() for w in ws]:
            w.read()  # ready: its arrays made
        out = []
        for (procs, threads), workers in groups.items():
            start = time.monotonic() + 0.1
            for w in workers:
                w.send({"cmd": "triad", "start": start, "window_s": window_s})
            out.append({"procs": procs, "threads": threads, "gb_s": _sig(sum(w.read()["gb_s"] for w in workers))})
        return out
    finally:
        for w in [w for ws in groups.values() for w in ws]:
            w.close()


def measure_roofline(layouts: list[tuple[int, int]], shapes: list[tuple[int, int, int]], threads: int,
                     echo: Callable[[str], None] = print, mib: int | None = None) -> dict:
    """The machine's limits for a run: the triad bandwidth of every ``(procs, threads)`` layout (arrays
    of ``mib`` MiB, default :data:`TRIAD_MIB`; windows of :data:`TRIAD_WINDOW_S`) and the GEMM rates of
    :data:`GEMM_DTYPES` at ``shapes`` with ``threads`` (all the run's cores); says
    :func:`roofline_text`. Returns ``{"triad_mib", "bandwidth": [{"procs", "threads", "gb_s"}],
    "gemm": {dtype: {"gflop_s", "by_shape"} or None}, "load_avg", "measure_s"}`` (``load_avg``: the
    1-minute load average as it started, None where the OS has none).

    Raises:
        RuntimeError: a triad worker died.
    """
    mib = TRIAD_MIB if mib is None else mib
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # a busy machine's limits read low
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpengine-roofline-") as logdir:
        bandwidth = triad_bandwidths(layouts, Path(logdir), mib, TRIAD_WINDOW_S)
    result = {"triad_mib": mib, "bandwidth": bandwidth, "gemm": gemm_rates(shapes, threads, GEMM_WINDOW_S),
              "load_avg": None if load is None else round(load, 2)}
    result["measure_s"] = round(time.perf_counter() - t0, 1)
    echo(roofline_text(result))
    return result


def gemm_shapes(hf_config, num_prompts: int, input_len: int) -> list[tuple[int, int, int]]:
    """The GEMMs timed: ``[M, hidden] x [hidden, intermediate]`` at M = ``num_prompts`` (the
    throughput workload's decode batch) and its prefill rows ``num_prompts x input_len`` (at most
    :data:`GEMM_MAX_ROWS`); intermediate = the config's ``intermediate_size`` (else 4 x hidden)."""
    text = hf_config.get_text_config()
    k = text.hidden_size
    n = getattr(text, "intermediate_size", None) or 4 * k
    return list(dict.fromkeys([(num_prompts, k, n), (min(num_prompts * input_len, GEMM_MAX_ROWS), k, n)]))


def _serve_triad(threads: int, mib: int) -> None:
    """The triad worker: make its :func:`triad_arrays`, say ready, then answer each ``{"cmd": "triad",
    "start", "window_s"}`` line with :func:`triad_best` until ``{"cmd": "quit"}`` or the end of stdin."""
    arrays = triad_arrays(threads, mib)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") != "triad":
            return
        print(MARK + json.dumps(triad_best(arrays, cmd["start"], cmd["window_s"])), flush=True)


app = typer.Typer(add_completion=False)


@app.command()
def main(
    model: Annotated[str, typer.Option(help="HF model folder (the GEMM shapes)")] = "",
    num_prompts: Annotated[int, typer.Option(help="the throughput workload's requests (the decode GEMM's M)")] = 64,
    input_len: Annotated[int, typer.Option(help="its prompt tokens (the prefill GEMM's M / num_prompts)")] = 128,
    tp: Annotated[list[int], typer.Option(help="the layouts: tp processes of cores / tp threads")] = None,
    threads: Annotated[int, typer.Option(help="cores (0 = the affinity mask); a triad worker's threads")] = 0,
    mib: Annotated[int, typer.Option(help="MiB of each triad array")] = TRIAD_MIB,
    triad_worker: Annotated[bool, typer.Option("--triad-worker", hidden=True)] = False,
) -> None:
    """Measure the machine's roofline (triad bandwidth per layout, GEMM rate per dtype) and print it."""
    if triad_worker:
        return _serve_triad(threads, mib)
    from transformers import AutoConfig

    from benchmarks.machine import cpu_cores
    from tpengine.config import DEFAULT_MODEL_DIR

    tps = tp or [1, 2]
    if min(num_prompts, input_len, mib, *tps) < 1 or threads < 0:
        raise typer.BadParameter("--num-prompts, --input-len, --mib and --tp must be >= 1, --threads >= 0")
    cores = threads or cpu_cores()
    try:
        cfg = AutoConfig.from_pretrained(model or DEFAULT_MODEL_DIR)
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--model {model or DEFAULT_MODEL_DIR!r}: cannot read its config.json ({e})") from None
    layouts = [(t, max(1, cores // t)) for t in tps]
    measure_roofline(layouts, gemm_shapes(cfg, num_prompts, input_len), cores, typer.echo, mib)


if __name__ == "__main__":
    app()
