"""The GEMV kernels' rows (tpengine.backends.cpu.cpu_gemv, cpu_gemv.c): each row of a call of 1..8 rows is the
one-row call on that row bit for bit, over output counts with tails (groups of 4 weight rows, then one at a
time) and 1 and 2 threads, bfloat16 and float32, and within a float64 product's bound (AVX2: bfloat16 widened
by pairs, the even and odd elements' two FMA chains; AVX-512: vdpbf16ps). Also run under the AVX2 build
(tests/test_isa_avx2.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_gemv, cpu_library


@pytest.mark.skipif(not cpu_library.has("tpe_gemv_bf16", "tpe_gemv_f32"),
                    reason=str(cpu_library.missing("tpe_gemv_bf16", "tpe_gemv_f32")))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_the_one_row_product_bit_for_bit(dtype, threads, torch_threads):
    torch.manual_seed(6)
    torch_threads(threads)
    for n, k in ((1, 32), (3, 64), (75, 96), (130, 576), (577, 1536)):
        w = (torch.randn(n, k) * 0.1).to(dtype)
        x = torch.randn(cpu_gemv.MAX_ROWS, k).to(dtype)
        one = torch.cat([cpu_gemv.gemv(x[i:i + 1], w) for i in range(cpu_gemv.MAX_ROWS)])
        exact = F.linear(x.double(), w.double())
        bound = F.linear(x.double().abs(), w.double().abs()) * k * 2 ** -24 + (
            exact.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0)
        assert ((one.double() - exact).abs() <= bound).all(), (n, k)
        for rows in range(1, cpu_gemv.MAX_ROWS + 1):
            assert torch.equal(cpu_gemv.gemv(x[:rows], w), one[:rows]), (n, k, rows)
