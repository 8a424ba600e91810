"""``tpengine-shard``'s one-line errors: unreadable model folders, config.json and manifest.json,
an output folder that cannot be made (exit 2, naming the file, no traceback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import make_tiny_model
from test_shard_tool import cli

from shard_tool.split import split_model


def test_unreadable_inputs_and_unwritable_out_are_one_line(tmp_path: Path) -> None:
    """split / info / verify: a broken config.json, a truncated or incomplete manifest.json, a
    model_type transformers does not know, an --out that cannot be made: one line naming the
    file, exit 2."""
    model_dir = make_tiny_model(tmp_path, "llama")
    split_model(model_dir, 2, tmp_path / "tp2")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama",')
    msg = (f"error: model config {str(broken / 'config.json')!r} is not valid JSON (truncated or damaged?): "
           "Expecting property name enclosed in double quotes: line 1 column 24 (char 23)\n")
    for args in (("split", broken, "--tp", "2", "--out", tmp_path / "x"), ("info", broken)):
        r = cli(*args)
        assert (r.exit_code, r.stderr) == (2, msg), r.output
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "nosuch"}')
    r = cli("info", unknown)
    assert r.exit_code == 2 and r.stderr.startswith(
        f"error: model config {str(unknown / 'config.json')!r} cannot be read by transformers: The checkpoint you "
        "are trying to load has model type `nosuch`") and r.stderr.count("\n") == 1
    manifest = tmp_path / "tp2" / "manifest.json"
    full = manifest.read_text()
    manifest.write_text(full[: len(full) // 2])
    r = cli("verify", tmp_path / "tp2")
    assert r.exit_code == 2 and r.stderr.startswith(
        f"error: shard manifest {str(manifest)!r} is not valid JSON (truncated or damaged?): ")
    m = json.loads(full)
    del m["shard_files"]
    manifest.write_text(json.dumps(m))
    r = cli("verify", tmp_path / "tp2")
    assert (r.exit_code, r.stderr) == (2, f"error: shard manifest {str(manifest)!r}: key 'shard_files' is missing "
                                          "or not a JSON array; re-run tpengine-shard split\n")
    target = Path("/sys/tpengine-shards") if os.geteuid() == 0 else tmp_path / "ro" / "shards"
    if os.geteuid() != 0:
        target.parent.mkdir(mode=0o500)
    r = cli("split", model_dir, "--tp", "2", "--out", target)
    assert r.exit_code == 2 and r.stderr.startswith(f"error: cannot create output folder '{target}.tmp' "
                                                    f"(written, then renamed to '{target}'): "), r.output
    assert r.stderr.count("\n") == 1
