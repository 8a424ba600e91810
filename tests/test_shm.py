"""The shared-memory all-reduce (tpengine/backends/cpu/shm.py, its C fast path tpengine/backends/cpu/csrc/cpu_shm.c):
sums in rank order equal to torch's, float32 and bfloat16, at 2 and 3 ranks, odd lengths (the C
tail), the hand-over to the Python wait when a peer is late (the C wait gives up after SPIN_NS),
and the all-reduce fused with the residual add and RMSNorm equal to the two steps."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from tpengine.backends.cpu import cpu_fused, cpu_library, shm

# the C all-reduce's tests; the row-parallel partial sum runs on every machine
needs_kernels = pytest.mark.skipif(cpu_library.missing("tpe_shm_all_reduce") is not None,
                                   reason=str(cpu_library.missing("tpe_shm_all_reduce")))

SLOT = 1 << 17


def tensor(rank: int, call: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(n, generator=g).to(dtype)


def expected(size: int, call: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``((t_0 + t_1) + t_2) ...``, each sum rounded to ``dtype`` (what every rank must get)."""
    out = tensor(0, call, n, dtype) + tensor(1, call, n, dtype)
    for r in range(2, size):
        out = out + tensor(r, call, n, dtype)
    return out


CALLS = [(37, torch.bfloat16), (64 * 576, torch.bfloat16), (1000, torch.float32), (5, torch.float32),
         (64 * 576, torch.bfloat16)]


def worker(rank: int, size: int, path: str, late: int, spin_ns: int, tokens, out) -> None:
    shm.SPIN_NS = spin_ns
    comm = shm.ShmComm(rank, size, path, SLOT, timeout_s=30.0)
    codes = []
    fast = comm._fast

    def traced(*a):
        codes.append(fast(*a))
        # the late rank goes on only once the others' C waits have given up (no sleep: no timing guess)
        if 0 <= late != rank and (len(codes) == 3 or (rank > 0 and len(codes) == len(CALLS) + 1)):
            tokens.put(len(codes))
        return codes[-1]

    comm._fast = traced
    waiting = [r for r in range(size) if r != late]
    got = []
    for call, (n, dtype) in enumerate(CALLS):
        if rank == late and call == 2:  # the others' second C wait runs out; they finish in Python
            assert sorted(tokens.get(timeout=60) for _ in waiting) == [3] * len(waiting)
        t = tensor(rank, call, n, dtype)
        got.append(torch.equal(comm.all_reduce(t), expected(size, call, n, dtype)))
    if rank == late:  # the driver waits in the gather; the others run a call ahead: their first wait runs out
        ahead = [r for r in waiting if r > 0]
        assert sorted(tokens.get(timeout=60) for _ in ahead) == [len(CALLS) + 1] * len(ahead)
    gathered = comm.gather_to_driver(torch.full((2,), float(rank)), dim=0)
    t = tensor(rank, 9, 100, torch.bfloat16)
    got.append(torch.equal(comm.all_reduce(t), expected(size, 9, 100, torch.bfloat16)))
    # the all-reduce fused with the residual add and RMSNorm: what the two steps give
    for call, dtype in ((10, torch.bfloat16), (11, torch.float32)):
        rows, n = 7, 48
        h, w = tensor(99, call, rows * n, dtype).view(rows, n), tensor(98, call, n, dtype)
        t = tensor(rank, call, rows * n, dtype).view(rows, n)
        fused = comm.all_reduce_add_rms_norm(t, h, w, 1e-5)
        want = cpu_fused.add_rms_norm(h, expected(size, call, rows * n, dtype).view(rows, n), w, 1e-5, True)
        got.append(fused is not None and all(torch.equal(a, b) for a, b in zip(fused, want)))
    out.put((rank, got, None if gathered is None else gathered.tolist(), codes))


@needs_kernels
@pytest.mark.parametrize("size, late, spin_ns", [(2, -1, shm.SPIN_NS), (3, -1, shm.SPIN_NS), (2, 1, 1_000_000),
                                                 (3, 2, 1_000_000)])
def test_all_reduce_equals_torch_sums(tmp_path, size, late, spin_ns):
    path = tmp_path / "shm"
    path.write_bytes(bytes(shm.HEADER + 2 * size * SLOT))
    ctx = mp.get_context("spawn")
    out, tokens = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, size, str(path), late, spin_ns, tokens, out))
             for r in range(size)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [r[0] for r in results] == list(range(size))
    assert all(ok == [True] * (len(CALLS) + 3) for _, ok, _, _ in results), results
    assert results[0][2] == [float(r) for r in range(size) for _ in range(2)]
    assert all(g is None for _, _, g, _ in results[1:])
    # every all-reduce took the C path; a late peer makes the others' C waits hand over to Python: the
    # second wait (2) at the late call, the first (1) on ranks > 0 after the gather (they ran ahead)
    for rank, _, _, codes in results:
        assert len(codes) == len(CALLS) + 1 and set(codes) <= {0, 1, 2}, (rank, codes)
        if 0 <= late != rank:
            assert codes[2] == 2, (rank, codes)
            assert rank == 0 or codes[-1] == 1, (rank, codes)


def test_row_parallel_partial_sum_needs_no_bias():
    from tpengine.model.layers.linear import RowParallelLinear

    m = RowParallelLinear(4, 3, bias=True, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"^RowParallelLinear: reduce=False needs a layer without bias"):
        m(torch.ones(2, 4), reduce=False)
    m = RowParallelLinear(4, 3, bias=False, dtype=torch.float32, device="cpu")
    torch.nn.init.ones_(m.weight)
    assert torch.equal(m(torch.ones(2, 4), reduce=False), torch.full((2, 3), 4.0))
