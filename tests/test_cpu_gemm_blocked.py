"""The float32 GEMM on the blocked layout at many rows (``cpu_gemm.c``'s ``tpe_gemm_blocked_f32``): the same
products as the blocked layout's own kernel, bit for bit, at every tail (rows not a multiple of the 6-row tile,
blocks not a multiple of the 4-block panel, more rows than one L2 chunk), 1 and 2 threads; what the blocked
layout's bound linear runs from ``cpu_gemm.MIN_ROWS`` rows on; and its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_blocked, cpu_gemm, cpu_library, linear_layout

needs = pytest.mark.skipif(not cpu_library.has(cpu_gemm.BLOCKED_KERNEL, *cpu_blocked.KERNELS_F32),
                           reason=str(cpu_library.missing(cpu_gemm.BLOCKED_KERNEL, *cpu_blocked.KERNELS_F32)))
#: (n, k): 1, 2, 3, 5, 7 and 36 blocks of 16 rows; an odd k; a k whose L2 chunk is a few dozen rows, so 300 rows
#: run as several chunks on any L2 up to 8 MiB
SHAPES = ((16, 8), (32, 64), (48, 130), (80, 96), (112, 576), (576, 96), (48, 4096))
ROWS = (1, 2, 5, 6, 7, 13, 17, 64, 65, 300)


@needs
@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_gemm_equals_the_blocked_kernel_bit_for_bit(threads, torch_threads):
    """Every output is the k-term FMA chain from zero in k order in both kernels, so they are equal (and within
    k float32 steps of a float64 reference); each row equals the same row multiplied alone."""
    torch.manual_seed(5)
    torch_threads(threads)
    for n, k in SHAPES:
        w = torch.randn(n, k)
        b = cpu_blocked.pack(w)
        assert cpu_gemm.blocked_available(b)
        x = torch.randn(max(ROWS), k)
        for rows in ROWS:
            got = cpu_gemm.blocked_gemm(x[:rows], b)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            assert torch.equal(got, cpu_blocked.linear(x[:rows], b)), (n, k, rows)
            exact = F.linear(x[:rows].double(), w.double())
            bound = F.linear(x[:rows].abs().double(), w.abs().double()) * k * 2 ** -24
            assert ((got.double() - exact).abs() <= bound).all(), (n, k, rows)
        assert torch.equal(cpu_gemm.blocked_gemm(x[7:8], b), cpu_gemm.blocked_gemm(x, b)[7:8])
        assert cpu_gemm.blocked_gemm(x[:0], b).shape == (0, n)


@needs
def test_the_blocked_layouts_linear_runs_it_from_min_rows_and_keeps_the_one_row_call():
    """``bind_linear`` of a float32 blocked weight: the blocked kernel below ``cpu_gemm.MIN_ROWS`` rows, the GEMM
    from there (the same values either way), the blocked kernel's call in a decode program; a bias is added."""
    torch.manual_seed(6)
    w, bias = torch.randn(96, 64), torch.randn(96)
    b = cpu_blocked.pack(w)
    run = linear_layout.bind_linear(None, None, b)
    assert run.c_spec == cpu_blocked.bind(b).c_spec
    calls = []
    real = cpu_library.load()

    class Counting:  # counts the two C functions' calls, passes everything through
        def __getattr__(self, name):
            fn = getattr(real, name)
            return (lambda *a: (calls.append(name), fn(*a))[1]) if name.startswith("tpe_") else fn
    for rows in (1, cpu_gemm.MIN_ROWS - 1, cpu_gemm.MIN_ROWS, 64, 200):
        x = torch.randn(rows, 64)
        old = cpu_library.load
        cpu_library.load = lambda: Counting()
        try:
            calls.clear()
            got = linear_layout.bind_linear(None, None, b)(x)
        finally:
            cpu_library.load = old
        want = "tpe_gemm_blocked_f32" if rows >= cpu_gemm.MIN_ROWS else "tpe_blocked_gemm_f32"
        assert calls == [want] and torch.equal(got, cpu_blocked.linear(x, b)), rows
    assert torch.equal(linear_layout.bind_linear(None, bias, b)(torch.ones(20, 64)),
                       cpu_blocked.linear(torch.ones(20, 64), b) + bias)


@needs
def test_blocked_gemm_refusals_name_the_value():
    b = cpu_blocked.pack(torch.randn(32, 8))
    with pytest.raises(ValueError, match=r"blocked gemm: x \[rows, k\] float32 against a float32 blocked "
                                         r"\[n/16, k, 16\] weight; got x torch\.float32 \(3, 9\), weight "
                                         r"torch\.float32 \(2, 8, 16\)"):
        cpu_gemm.blocked_gemm(torch.ones(3, 9), b)
    with pytest.raises(ValueError, match=r"got x torch\.bfloat16 \(3, 8\)"):
        cpu_gemm.blocked_gemm(torch.ones(3, 8, dtype=torch.bfloat16), b)
    plain = torch.randn(32, 8)
    assert not cpu_gemm.blocked_available(plain) and not cpu_gemm.blocked_available(None)
    with pytest.raises(ValueError, match=r"blocked gemm: cannot take a torch\.float32 weight \(32, 8\)"):
        cpu_gemm.bind_blocked(plain)
