"""The blocked weight layouts (tpengine.backends.cpu.cpu_blocked, cpu_blocked.c): the packing is a permutation
(unpacked back bit for bit), and the GEMM at 1..9, 17 and 64 rows, 1 and 2 threads, over shapes with 1..7 blocks of
16 outputs (the 4- and 2-block groups, the panels and their tails), is the float32 product (bfloat16: rounded once)
but for the order of the float32 sum, each row bit-equal to the one-row product on it whatever the rows beside it
(bfloat16: vdpbf16ps on AVX512-BF16, pairs widened by shift / mask and FMAs on AVX2; both also run under the AVX2
build, tests/test_isa_avx2.py); the float32 layout's rows are each F.linear's one-row product too; a tied table's
rows gathered from either layout; what they refuse, by name. On a CPU with AMX-BF16, the bfloat16 GEMM's tile
path from its row threshold on: the same bound, within one bfloat16 step of the vdpbf16ps path (not bit-equal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpengine.backends.cpu import cpu_blocked, cpu_library

needs_bf16 = pytest.mark.skipif(not cpu_library.has(*cpu_blocked.KERNELS),
                                reason=str(cpu_library.missing(*cpu_blocked.KERNELS)))
needs_f32 = pytest.mark.skipif(not cpu_library.has(*cpu_blocked.KERNELS_F32),
                               reason=str(cpu_library.missing(*cpu_blocked.KERNELS_F32)))
SHAPES = ((16, 2), (32, 64), (48, 96), (64, 576), (112, 130), (768, 576))
ROWS = (*range(1, 10), 17, 64)


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_gemm_is_the_float32_product_rounded_once(threads, torch_threads):
    torch.manual_seed(3)
    torch_threads(threads)
    for n, k in SHAPES:
        w = torch.randn(n, k, dtype=torch.bfloat16)
        b = cpu_blocked.pack(w)
        assert b.shape == (n // 16, k // 2, 16, 2) and cpu_blocked.is_blocked(b)
        assert cpu_blocked.shape(b) == (n, k) and torch.equal(cpu_blocked.unpack(b), w)
        x = torch.randn(max(ROWS), k, dtype=torch.bfloat16)
        one = torch.cat([cpu_blocked.linear(x[i:i + 1], b) for i in range(17)])
        for rows in ROWS:
            exact = F.linear(x[:rows].float(), w.float())
            got = cpu_blocked.linear(x[:rows], b)
            # rounded once to bfloat16 (half a step: 2^-9 relative) plus the float32 sum's order
            assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * k ** 0.5).all(), (n, k, rows)
            # a row's sum is the same whatever the pass or panel it ran in (both vector paths)
            assert torch.equal(got[:17], one[:rows]), (n, k, rows)


@needs_f32
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_blocked_gemm_is_the_product_up_to_the_sum_order(threads, torch_threads):
    """Against a float64 reference: each output a k-term float32 FMA chain, so within k float32 rounding steps
    of the sum of magnitudes; every row bit-equal to the same row multiplied alone (one row's chain is the
    same whatever the pass or panel it ran in), and to the odd k (130) and the 3 / 5 / 7-block tails."""
    torch.manual_seed(4)
    torch_threads(threads)
    for n, k in SHAPES:
        w = torch.randn(n, k)
        b = cpu_blocked.pack(w)
        assert b.shape == (n // 16, k, 16) and b.dtype == torch.float32 and cpu_blocked.is_blocked(b)
        assert cpu_blocked.shape(b) == (n, k) and torch.equal(cpu_blocked.unpack(b), w)
        x = torch.randn(max(ROWS), k)
        one = torch.cat([cpu_blocked.linear(x[i:i + 1], b) for i in range(17)])
        for rows in ROWS:
            got = cpu_blocked.linear(x[:rows], b)
            exact = F.linear(x[:rows].double(), w.double())
            bound = F.linear(x[:rows].abs().double(), w.abs().double()) * k * 2 ** -24
            assert got.dtype == torch.float32 and ((got.double() - exact).abs() <= bound).all(), (n, k, rows)
            assert torch.equal(got[:17], one[:rows]), (n, k, rows)
        assert ((F.linear(x[:17], w) - one).abs() <= F.linear(x[:17].abs(), w.abs()) * k * 2 ** -23).all()


@needs_f32
def test_blocked_refusals_name_the_value():
    with pytest.raises(ValueError) as e:
        cpu_blocked.pack(torch.zeros(24, 32))
    assert str(e.value) == ("blocked layout: a CPU [n, k] weight with n % 16 == 0, bfloat16 (k even) or float32, "
                            f"an AVX-512 or AVX2 build; got torch.float32 (24, 32) on cpu, build "
                            f"{cpu_library.isa()}")
    assert not cpu_blocked.available(torch.zeros(32, 32, dtype=torch.float16))
    assert not cpu_blocked.available(torch.zeros(32, 32, dtype=torch.bfloat16)) or cpu_library.has(*cpu_blocked.KERNELS)
    assert cpu_blocked.available(torch.zeros(32, 31)) and not cpu_blocked.is_blocked(torch.zeros(2, 16, 16, 2))
    assert not cpu_blocked.is_blocked(torch.zeros(2, 16, 16, dtype=torch.bfloat16))
    assert not cpu_blocked.is_blocked(torch.zeros(32, 16)) and not cpu_blocked.is_blocked(None)
    b = cpu_blocked.pack(torch.zeros(32, 32))
    for x in (torch.zeros(1, 30), torch.zeros(1, 32, dtype=torch.bfloat16)):
        with pytest.raises(ValueError) as e:
            cpu_blocked.linear(x, b)
        assert str(e.value) == ("blocked linear: x [rows, k] of the weight's dtype against a [n/16, k/2, 16, 2] "
                                f"bfloat16 or [n/16, k, 16] float32 weight; got x {x.dtype} {tuple(x.shape)}, weight "
                                "torch.float32 (2, 32, 16)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_gathered_from_the_blocked_layout_are_the_plain_rows(dtype):
    """An embedding's lookup from a blocked table (a tied head's): row r from [r / 16, :, r % 16], bit-equal."""
    if not cpu_blocked.available(torch.zeros(16, 2, dtype=dtype)):
        pytest.skip(f"no blocked {dtype} kernels in this build ({cpu_library.isa()})")
    torch.manual_seed(5)
    w = torch.randn(4096, 576, dtype=dtype)
    b = cpu_blocked.pack(w)
    ids = torch.cat([torch.tensor([0, 15, 16, 4095]), torch.randint(0, 4096, (60,))]).view(8, 8)
    assert torch.equal(cpu_blocked.rows(b, ids), F.embedding(ids, w))
    assert torch.equal(cpu_blocked.rows(b, torch.tensor(17)), w[17])
    x = torch.randn(1, 576, dtype=dtype)  # the head shape's logits, as the GEMM tests bound them
    exact = F.linear(x.double(), w.double())
    got = cpu_blocked.linear(x, b).double()
    if dtype == torch.bfloat16:
        assert ((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * 576 ** 0.5).all()
    else:
        assert ((got - exact).abs() <= F.linear(x.abs().double(), w.abs().double()) * 576 * 2 ** -24).all()


@pytest.fixture
def amx_rows():
    """``set(rows)``: the bfloat16 blocked GEMM's AMX row threshold for this test (cpu_blocked.set_amx_rows), the
    one before it restored at teardown."""
    old = cpu_blocked.amx_rows()
    yield cpu_blocked.set_amx_rows
    cpu_blocked.set_amx_rows(old)


@needs_bf16
@pytest.mark.skipif(not cpu_blocked.amx_available(), reason="no AMX-BF16 here (CPU, OS permission or an AVX2 build): "
                    "the blocked GEMM has no AMX path to test")
@pytest.mark.parametrize("threads", [1, 2])
def test_blocked_gemm_amx_rows(threads, torch_threads, amx_rows):
    """From the AMX threshold on, the rows run tile multiplies: each output the float32 product rounded once to
    bfloat16 (the same bound as the vdpbf16ps path), within one bfloat16 step of the vdpbf16ps path's (the tile
    multiply's float32 sums round otherwise: not bit-equal, docs/notes/kernels.md), over the row tails (1..33,
    < 16 rows in a zero-padded tile), k's tail past the last 32 (k = 34, 130: vdpbf16ps after the tiles) and odd
    block counts; below the threshold the call is the vdpbf16ps path, bit for bit."""
    torch.manual_seed(5)
    torch_threads(threads)
    for n, k in ((16, 2), (48, 34), (112, 130), (96, 576)):
        w = torch.randn(n, k, dtype=torch.bfloat16)
        b = cpu_blocked.pack(w)
        x = torch.randn(70, k, dtype=torch.bfloat16)
        amx_rows(0)
        vec = cpu_blocked.linear(x, b)
        amx_rows(1)
        for rows in (1, 2, 15, 16, 17, 33, 70):
            got = cpu_blocked.linear(x[:rows], b)
            exact = F.linear(x[:rows].float(), w.float())
            assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * k ** 0.5).all(), (n, k, rows)
            # one bfloat16 step of the output's magnitude apart at most
            step = torch.maximum(got.float().abs(), vec[:rows].float().abs()) * 2 ** -7
            assert ((got.float() - vec[:rows].float()).abs() <= step).all(), (n, k, rows)
        amx_rows(17)  # below it, the vdpbf16ps path
        assert torch.equal(cpu_blocked.linear(x[:16], b), vec[:16])
    assert cpu_blocked.amx_rows() == 17
    # rows in chunks of half the L2 (k = 4096: 128 rows a chunk on a 2 MiB L2, 64 on 1 MiB): past a chunk; past
    # two at 2 threads, so the threads split the rows (each copies its own into A tiles) instead of the blocks:
    # the same bits as the blocks' split (each output's sum is the same tile multiplies in k's order)
    w, x = torch.randn(32, 4096, dtype=torch.bfloat16), torch.randn(300, 4096, dtype=torch.bfloat16)
    b = cpu_blocked.pack(w)
    for rows in (150, 300):
        got, exact = cpu_blocked.linear(x[:rows], b), F.linear(x[:rows].float(), w.float())
        assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * 64).all()
        assert torch.equal(got[:150], cpu_blocked.linear(x[:150], b))
    # a y larger than the L2 (4.3 MB here) is written with non-temporal stores
    w, x = torch.randn(1024, 64, dtype=torch.bfloat16), torch.randn(2100, 64, dtype=torch.bfloat16)
    got, exact = cpu_blocked.linear(x, cpu_blocked.pack(w)).float(), F.linear(x.float(), w.float())
    assert ((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * 8).all()


def test_amx_rows_setting_without_amx(amx_rows):
    """Where the AMX path does not run, a threshold is not taken (amx_rows stays 0) and choose_amx sets nothing."""
    amx_rows(8)
    assert cpu_blocked.amx_rows() == (8 if cpu_blocked.amx_available() else 0)
    if not cpu_blocked.amx_available():
        assert cpu_blocked.choose_amx([(576, 576)]) is None and cpu_blocked.amx_rows() == 0
