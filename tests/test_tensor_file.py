"""tpengine.model.tensor_file: safetensors read by byte range into place, written tensor by tensor."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpengine.model.tensor_file import TensorFileWriter, read_header, read_rows


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g).bfloat16(),
            "i": torch.arange(6, dtype=torch.int64).view(2, 3), "empty": torch.zeros(0, 4)}


def test_header_matches_the_library(tmp_path: Path, tensors) -> None:
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    infos = read_header(path)
    assert set(infos) == set(tensors)
    for name, t in tensors.items():
        assert infos[name].dtype == t.dtype and infos[name].shape == tuple(t.shape)
        assert infos[name].nbytes == t.numel() * t.element_size()
    assert [i.offset for i in infos.values()] == sorted(i.offset for i in infos.values())  # file order


def test_read_rows_whole_slices_and_casts(tmp_path: Path, tensors) -> None:
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    infos = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        w = tensors["w"]
        whole = torch.empty(7, 5)
        read_rows(fd, infos["w"], whole)
        assert torch.equal(whole, w)
        rows = torch.empty(3, 5)
        read_rows(fd, infos["w"], rows, dim=0, start=2)
        assert torch.equal(rows, w[2:5])
        cols = torch.empty(7, 2, dtype=torch.bfloat16)  # a dim-1 slice, cast on the way
        read_rows(fd, infos["w"], cols, dim=1, start=3)
        assert torch.equal(cols, w[:, 3:5].bfloat16())
        b = torch.empty(5)
        read_rows(fd, infos["b"], b)
        assert torch.equal(b, tensors["b"].float())
        with pytest.raises(ValueError, match=r"cannot read rows 5:8 along dim 0 of tensor 'w' \[7, 5\]"):
            read_rows(fd, infos["w"], torch.empty(3, 5), dim=0, start=5)
        with pytest.raises(ValueError, match=r"into a \[3, 4\] tensor"):
            read_rows(fd, infos["w"], torch.empty(3, 4))
    finally:
        os.close(fd)


def test_chunked_cast_and_column_reads(tmp_path: Path, monkeypatch) -> None:
    """Reads that stage through a buffer (a cast, a column slice) give the same values in chunks."""
    import tpengine.model.tensor_file as tf

    monkeypatch.setattr(tf, "CHUNK_BYTES", 64)  # 16 float32 values per chunk
    w = torch.randn(9, 7)
    path = tmp_path / "w.safetensors"
    save_file({"w": w}, path)
    info = read_header(path)["w"]
    fd = os.open(path, os.O_RDONLY)
    try:
        cast = torch.empty(4, 7, dtype=torch.bfloat16)
        read_rows(fd, info, cast, dim=0, start=5)
        assert torch.equal(cast, w[5:].bfloat16())
        cols = torch.empty(9, 3)
        read_rows(fd, info, cols, dim=1, start=4)
        assert torch.equal(cols, w[:, 4:])
    finally:
        os.close(fd)


def test_truncated_and_foreign_files(tmp_path: Path, tensors) -> None:
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-8])
    with pytest.raises(ValueError, match="does not fit its shape or the .*-byte file \\(truncated\\?\\)"):
        read_header(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
    with pytest.raises(ValueError, match="its header is not JSON"):
        read_header(junk)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"abc")
    with pytest.raises(ValueError, match="3 bytes, no header"):
        read_header(tiny)


def test_writer_round_trip_and_order(tmp_path: Path, tensors) -> None:
    path = tmp_path / "out.safetensors"
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    w = TensorFileWriter(path, entries, metadata={"rank": "0"})
    for n, t in tensors.items():
        w.write(n, t)
    w.close()
    back = load_file(path)  # the library reads what we wrote
    assert set(back) == set(tensors) and all(torch.equal(back[n], t) for n, t in tensors.items())
    w = TensorFileWriter(tmp_path / "bad.safetensors", entries)
    with pytest.raises(ValueError, match="write of 'b'"):
        w.write("b", tensors["b"])
    with pytest.raises(ValueError, match="4 declared tensor\\(s\\) never written, first 'w'"):
        w.close()


def test_column_slices_land_in_place_through_short_reads(tmp_path: Path, monkeypatch) -> None:
    """A dim-1 slice in the checkpoint's dtype is read row by row into ``dest`` (no staging): equal to
    the safetensors library's tensor for every start, all columns, a few rows per ``preadv`` and a
    ``preadv`` that stops after 5 bytes."""
    import tpengine.model.tensor_file as tf

    g = torch.Generator().manual_seed(1)
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(11, 9, generator=g).bfloat16(), "v": torch.randn(3, generator=g)}, path)
    w = load_file(path)["w"]
    info = read_header(path)["w"]
    real = os.preadv
    calls = []

    def short(fd: int, bufs: list, offset: int) -> int:  # at most 5 bytes a call, as a short read gives
        calls.append(len(bufs))
        out = bytearray(5)
        got = real(fd, [out], offset)
        done = 0
        for b in bufs:
            n = min(len(b), got - done)
            b[:n] = out[done:done + n]
            done += n
        return got

    monkeypatch.setattr(tf, "IOV_MAX", 3)
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, width in ((0, 4), (3, 5), (8, 1), (0, 9)):
            cols = torch.empty(11, width, dtype=torch.bfloat16)
            read_rows(fd, info, cols, dim=1, start=start)
            assert torch.equal(cols, w[:, start:start + width]), (start, width)
        monkeypatch.setattr(tf.os, "preadv", short)
        cols = torch.empty(11, 4, dtype=torch.bfloat16)
        read_rows(fd, info, cols, dim=1, start=2)
        assert torch.equal(cols, w[:, 2:6])
        # every byte from row 0's slice to row 10's (94 bfloat16 values), 5 a call, at most 3 buffers a call
        assert max(calls) == 3 and len(calls) == -(-(11 * 9 - 2 - 3) * 2 // 5)
        whole = torch.empty(11, 9, dtype=torch.bfloat16)
        read_rows(fd, info, whole, dim=1, start=0)
        assert torch.equal(whole, w)
    finally:
        os.close(fd)


def test_map_rows_is_the_files_bytes_and_copy_on_write(tmp_path: Path) -> None:
    """A mapped row range equals the library's tensor; a write to it changes neither the file nor
    another mapping of it."""
    from tpengine.model.tensor_file import map_rows

    g = torch.Generator().manual_seed(3)
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(3, generator=g), "w": torch.randn(5000, 3, generator=g).bfloat16()}, path)
    w = load_file(path)["w"]
    info = read_header(path)["w"]
    fd = os.open(path, os.O_RDONLY)
    try:
        rows = map_rows(fd, info, 2000, start=2500)  # starts inside a page
        again = map_rows(fd, info, 5000)
        assert rows.shape == (2000, 3) and torch.equal(rows, w[2500:4500]) and torch.equal(again, w)
        rows.zero_()
        assert torch.equal(again, w) and torch.equal(load_file(path)["w"], w)
        with pytest.raises(ValueError, match=r"cannot map rows 4999:5001 of tensor 'w' \[5000, 3\]"):
            map_rows(fd, info, 2, start=4999)
    finally:
        os.close(fd)


def test_a_short_job_maps_its_whole_weights(tiny: Path, monkeypatch) -> None:
    """A short job's load (TPENGINE_JOB_TOKENS=1) maps every parameter that is one whole checkpoint tensor
    in its dtype (here all sizes: MAP_MIN_BYTES 0), and the merged gate/up one as one mapping (gate_proj
    and up_proj lie back to back in the file); it reads q/k/v (k, o, q, v in the file); every parameter
    equals a reading load's."""
    import tpengine.model.loader as loader
    from tpengine.distributed import TPInfo

    folder = tiny  # the session's tiny-llama: untied, vocabulary 49152 (24576 rows a rank at tp=2)
    tp = TPInfo(0, 1, 0, torch.device("cpu"))
    monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "0")
    read = dict(loader.load_model(folder, tp, torch.float32, cpu_linear="plain").module.named_parameters())
    monkeypatch.delenv("TPENGINE_MEASURE_BUDGET_S")
    monkeypatch.setenv("TPENGINE_JOB_TOKENS", "1")
    monkeypatch.setattr(loader, "MAP_MIN_BYTES", 0)
    names = []
    real = loader.map_rows
    monkeypatch.setattr(loader, "map_rows", lambda fd, info, *a: (names.append(info.name), real(fd, info, *a))[1])
    mapped = dict(loader.load_model(folder, tp, torch.float32, cpu_linear="plain").module.named_parameters())
    assert sorted(read) == sorted(mapped) and all(torch.equal(read[k], mapped[k]) for k in read)
    layers = max(int(n.split(".")[2]) for n in names if n.startswith("model.layers.")) + 1
    per_layer = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
                 "mlp.down_proj.weight", "mlp.gate_proj.weight")
    assert sorted(names) == sorted(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{n}" for i in range(layers) for n in per_layer])
    # rank 1 of 2 (no collective at load): its row ranges of the embedding and LM head (rows 24576-49151) and the
    # norms mapped, its q/k/v, gate/up, o and down slices read
    names.clear()
    rank1 = TPInfo(1, 2, 0, torch.device("cpu"))
    mapped = dict(loader.load_model(folder, rank1, torch.float32, cpu_linear="plain").module.named_parameters())
    monkeypatch.delenv("TPENGINE_JOB_TOKENS")
    monkeypatch.setenv("TPENGINE_MEASURE_BUDGET_S", "0")
    read = dict(loader.load_model(folder, rank1, torch.float32, cpu_linear="plain").module.named_parameters())
    assert sorted(read) == sorted(mapped) and all(torch.equal(read[k], mapped[k]) for k in read)
    assert sorted(names) == sorted(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{n}" for i in range(layers) for n in per_layer[:2]])
