"""The blocked bfloat16 weight layout (tpengine.backends.cpu.cpu_blocked, cpu_blocked.c): the packing is a
permutation (unpacked back bit for bit), and its GEMM at 1..9, 17 and 64 rows, 1 and 2 threads, over shapes with
1..7 blocks of 16 outputs (the 4- and 2-block groups and their tails), is the float32 product rounded once to
bfloat16 but for the order of the float32 sum; what it refuses, by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_blocked, cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.has(*cpu_blocked.KERNELS), reason="no AVX512-BF16 kernels here")


@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_gemm_is_the_float32_product_rounded_once(threads):
    torch.manual_seed(3)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((16, 2), (32, 64), (48, 96), (64, 576), (112, 130), (768, 576)):
            w = torch.randn(n, k, dtype=torch.bfloat16)
            b = cpu_blocked.pack(w)
            assert b.shape == (n // 16, k // 2, 16, 2) and cpu_blocked.is_blocked(b)
            assert cpu_blocked.shape(b) == (n, k) and torch.equal(cpu_blocked.unpack(b), w)
            for rows in (*range(1, 10), 17, 64):
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                exact = F.linear(x.float(), w.float())
                got = cpu_blocked.linear(x, b).float()
                # rounded once to bfloat16 (half a step: 2^-9 relative) plus the float32 sum's order
                assert ((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * k ** 0.5).all(), (n, k, rows)
    finally:
        torch.set_num_threads(old)


def test_blocked_refusals_name_the_value():
    with pytest.raises(ValueError) as e:
        cpu_blocked.pack(torch.zeros(24, 32, dtype=torch.bfloat16))
    assert str(e.value) == ("blocked layout: a contiguous CPU bfloat16 [n, k] weight with n % 16 == 0 and k even, "
                            "and an AVX512-BF16 build; got torch.bfloat16 (24, 32) on cpu")
    assert not cpu_blocked.available(torch.zeros(32, 32)) and not cpu_blocked.is_blocked(torch.zeros(2, 16, 16, 2))
    b = cpu_blocked.pack(torch.zeros(32, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError) as e:
        cpu_blocked.linear(torch.zeros(1, 30, dtype=torch.bfloat16), b)
    assert str(e.value) == ("blocked linear: x bfloat16 [rows, k] against a [n/16, k/2, 16, 2] weight; got x "
                            "torch.bfloat16 (1, 30), weight torch.bfloat16 (2, 16, 16, 2)")


def test_rows_gathered_from_the_blocked_layout_are_the_plain_rows():
    """An embedding's lookup from a blocked table (a tied head's): row r from [r / 16, :, r % 16, :], bit-equal."""
    w = torch.randn(4096, 576, dtype=torch.bfloat16)
    b = cpu_blocked.pack(w)
    ids = torch.cat([torch.tensor([0, 15, 16, 4095]), torch.randint(0, 4096, (60,))]).view(8, 8)
    assert torch.equal(cpu_blocked.rows(b, ids), F.embedding(ids, w))
    assert torch.equal(cpu_blocked.rows(b, torch.tensor(17)), w[17])
    x = torch.randn(1, 576, dtype=torch.bfloat16)  # the head shape's logits, as the GEMM tests bound them
    exact = F.linear(x.float(), w.float())
    assert ((cpu_blocked.linear(x, b).float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * 576 ** 0.5).all()
