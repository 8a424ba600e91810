"""The job guards its own files, before the model loads: ``--out`` is locked for the job's
lifetime, never one of its inputs (by file identity), writable; an unreadable model folder,
``config.json`` or ``manifest.json`` and a config file with an unknown table or key are one
``error:`` line and exit 2. Also: the loading and ready lines and ``--summary-json``."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from launch import cli
from test_cli import write_jsonl
from typer.testing import CliRunner

from tpengine.backends.cpu import cpu_library
from tpengine.config import load_config, read_config_file
from tpengine.entrypoints.cli import app
from tpengine.errors import UserError
from tpengine.frontend.writer import OutputWriter

VALID_SETTINGS = ("attention_backend, block_size, cpu_huge_pages, cpu_kernels, cpu_linear, data_parallel_size, "
                  "dist_timeout_s, dtype, "
                  "enable_chunked_prefill, enable_expert_parallel, "
                  "enable_prefix_caching, enforce_eager, generation_config, gpu_memory_utilization, kv_cache_dtype, "
                  "kv_cache_gb, kv_mirror, max_model_len, max_num_batched_tokens, max_num_seqs, model, num_kv_blocks, "
                  "pipeline_parallel_size, pooler_config, pp_layer_partition, quantization, reasoning_parser, runner, "
                  "seed, speculative_config, structured_outputs_backend, tensor_parallel_size, threads")


def run_cli(*args) -> tuple[int, str]:
    """``tpengine run ARGS`` in this process: (exit code, stderr)."""
    r = CliRunner().invoke(app, ["run", *map(str, args)])
    return r.exit_code, r.stderr


def unwritable_dir(tmp_path: Path) -> Path:
    """A folder this process cannot create files in (root ignores modes: /sys refuses new files)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir(mode=0o500)
        return d
    d = Path("/sys")
    try:
        os.close(os.open(d / "tpengine-probe", os.O_WRONLY | os.O_CREAT))
    except OSError:
        return d
    pytest.skip("no unwritable folder here")


@pytest.fixture
def job(tmp_path):
    """(prompts file, model folder with a config.json): enough for every check before the load."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    return write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}]), model


def test_config_file_refuses_unknown_tables_and_keys(tmp_path):
    p = tmp_path / "c.toml"
    cases = {
        "[engine]\nblock_size = 8\n[samplng]\ntemperature = 0\n":
            f"config file {str(p)!r}: unknown table [samplng]; valid tables: [engine], [sampling]",
        "block_size = 8\nfoo = 1\n":
            f"config file {str(p)!r}: unknown top-level key(s) ['foo']; valid: the tables [engine], [sampling], "
            f"or engine settings at top level: {VALID_SETTINGS}",
        "[engine]\nblok_size = 8\n":
            f"config file {str(p)!r}: unknown engine setting(s) ['blok_size'] in [engine]; valid: {VALID_SETTINGS}",
        "[sampling]\ntemprature = 0.0\n":
            f"config file {str(p)!r}: unknown [sampling] key(s) ['temprature']; valid: max_tokens, temperature, "
            "top_p, top_k, min_p, seed, stop, ignore_eos, n, presence_penalty, frequency_penalty, repetition_penalty, "
            "min_tokens, logit_bias, stop_token_ids, include_stop_str_in_output, skip_special_tokens, logprobs, "
            "prompt_logprobs",
        "seed = 1\n[engine]\nseed = 2\n":
            f"config file {str(p)!r}: ['seed'] set both at top level and in [engine]; set each once",
    }
    for text, message in cases.items():
        p.write_text(text)
        with pytest.raises(UserError) as e:
            read_config_file(p)
        assert str(e.value) == message
    p.write_text('block_size = 8\n[sampling]\ntemperature = 0.0\n')  # top-level settings beside [sampling]
    assert read_config_file(p) == {"engine": {"block_size": 8}, "sampling": {"temperature": 0.0}}
    assert load_config(p).block_size == 8


def test_bad_config_file_is_one_line_exit_2(tmp_path, job):
    prompts, model = job
    cfg = tmp_path / "c.toml"
    cfg.write_text("[samplng]\ntemperature = 0\n")
    code, err = run_cli("--prompts", prompts, "--model", model, "--config", cfg)
    assert (code, err) == (2, f"error: config file {str(cfg)!r}: unknown table [samplng]; valid tables: "
                              "[engine], [sampling]\n")
    code, err = run_cli("--prompts", prompts, "--model", model, "--config", tmp_path / "none.toml")
    assert (code, err) == (2, f"error: config file {str(tmp_path / 'none.toml')!r} does not exist\n")


def test_writer_locks_the_file_and_truncates_only_once_locked(tmp_path):
    p = tmp_path / "out.jsonl"
    first = OutputWriter(p)
    first.write({"id": "a"})
    for append in (False, True):
        with pytest.raises(UserError) as e:
            OutputWriter(p, append=append)
        assert str(e.value) == (f"--out {str(p)!r} is locked by another job writing to it; wait for that job to "
                                "finish or choose another --out")
    assert p.read_text() == '{"id": "a"}\n'  # the refused writer truncated nothing
    first.close()
    first.close()  # idempotent
    with OutputWriter(p, append=True) as w:  # the lock went with close
        w.write({"id": "b"})
    assert p.read_text() == '{"id": "a"}\n{"id": "b"}\n'
    OutputWriter(p).close()
    assert p.read_text() == ""
    bad = unwritable_dir(tmp_path) / "out.jsonl"
    with pytest.raises(UserError) as e:
        OutputWriter(bad)
    assert str(e.value) == f"cannot write --out {str(bad)!r}: Permission denied"


def test_out_guards_exit_2_before_the_model_loads(tmp_path, job):
    """A second job on a locked --out, a hard link to --prompts, an unwritable --out or
    --summary-json: exit 2, one line, --out untouched."""
    prompts, model = job
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old"}\n')
    with OutputWriter(out, append=True):  # another job holds --out
        code, err = run_cli("--prompts", prompts, "--model", model, "--out", out,
                            "--summary-json", tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()  # a summary file made for the refused job is removed
    assert (code, err) == (2, f"error: --out {str(out)!r} is locked by another job writing to it; wait for that "
                              "job to finish or choose another --out\n")
    assert out.read_text() == '{"id": "old"}\n'
    link = tmp_path / "link.jsonl"
    os.link(prompts, link)
    code, err = run_cli("--prompts", prompts, "--model", model, "--out", link)
    assert (code, err) == (2, f"error: --out {str(link)!r} is the --prompts file {str(prompts)!r}; it would be "
                              "overwritten\n")
    assert json.loads(prompts.read_text()) == {"id": "a", "prompt": "x"}
    bad = unwritable_dir(tmp_path) / "out.jsonl"
    code, err = run_cli("--prompts", prompts, "--model", model, "--out", bad)
    assert (code, err) == (2, f"error: cannot write --out {str(bad)!r}: Permission denied\n")
    code, err = run_cli("--prompts", prompts, "--model", model, "--out", out, "--summary-json", bad)
    assert (code, err) == (2, f"error: cannot write --summary-json {str(bad)!r}: Permission denied\n")
    code, err = run_cli("--prompts", prompts, "--model", model, "--out", out, "--summary-json", out)
    assert (code, err) == (2, f"error: --summary-json {str(out)!r} is the --out file {str(out)!r}; it would be "
                              "overwritten\n")
    assert out.read_text() == '{"id": "old"}\n'


def test_unreadable_model_folder_is_one_line_exit_2(tmp_path, job):
    """No folder, no / a broken / a non-object config.json, a truncated manifest.json: one line
    naming the file, before the model loads and before --out is touched."""
    prompts, _ = job
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old"}\n')
    m = tmp_path / "m"
    m.mkdir()
    cfg = m / "config.json"
    cases = [
        (None, f"{str(m)!r} is not a model folder: it has no config.json (pass a Hugging Face model folder or a "
               "tpengine-shard split folder)"),
        ('{"model_type": "llama",', f"model config {str(cfg)!r} is not valid JSON (truncated or damaged?): "
                                    "Expecting property name enclosed in double quotes: line 1 column 24 (char 23)"),
        ("[1]", f"model config {str(cfg)!r} is not a JSON object (got list)"),
        ("{}", f'model config {str(cfg)!r} has no "model_type" (a Hugging Face config.json names it, e.g. "llama")'),
    ]
    for text, message in cases:
        if text is not None:
            cfg.write_text(text)
        code, err = run_cli("--prompts", prompts, "--model", m, "--out", out)
        assert (code, err) == (2, f"error: {message}\n")
    cfg.write_text('{"model_type": "llama"}')
    (m / "manifest.json").write_text('{"format_version": 1, "tp_si')
    code, err = run_cli("--prompts", prompts, "--model", m, "--out", out)
    assert (code, err) == (2, f"error: shard manifest {str(m / 'manifest.json')!r} is not valid JSON (truncated or "
                              "damaged?): Unterminated string starting at: line 1 column 23 (char 22)\n")
    (m / "manifest.json").write_text('{"format_version": 1, "tp_size": 2}')
    code, err = run_cli("--prompts", prompts, "--model", m, "--out", out)
    assert (code, err) == (2, f"error: shard manifest {str(m / 'manifest.json')!r}: key 'plan' is missing or not a "
                              "JSON object; re-run tpengine-shard split\n")
    code, err = run_cli("--prompts", prompts, "--model", tmp_path / "nowhere", "--out", out)
    assert (code, err) == (2, f"error: model folder {str(tmp_path / 'nowhere')!r} does not exist (run `make model`, "
                              "or pass --model)\n")
    assert out.read_text() == '{"id": "old"}\n'


def test_summary_json_of_a_job_without_requests(tmp_path):
    prompts, summary = tmp_path / "empty.jsonl", tmp_path / "s.json"
    prompts.write_text("\n")
    code, err = run_cli("--prompts", prompts, "--model", tmp_path / "nowhere", "--summary-json", summary)
    assert (code, err) == (0, f"no requests in {prompts}: nothing to do\n")
    s = json.loads(summary.read_text())
    assert (s["requests_ok"], s["requests_error"], s["output_tokens"], s["peak_rss_bytes"]) == (0, 0, 0, None)


def test_load_lines_and_summary_json(tiny, tmp_path, measuring):
    """Rank 0 prints a line before the load, the CPU linear layouts it chose (issue 17), and one
    when ready (model, dtype, tp, KV blocks, seconds); --summary-json holds the summary ``drive``
    returns. The job measures its choices (``measuring``: the measured greedy pick's line is checked)."""
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello", "max_tokens": 2},
                                                  {"id": "b", "prompt": "Hi", "max_tokens": 3}])
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    p = cli(["--prompts", prompts, "--model", tiny, "--out", out, "--summary-json", summary, "--num-kv-blocks", 40,
             "--dtype", "float32"])
    lines = p.stderr.splitlines()
    assert lines[0] == f"tpengine: loading {tiny} (tp 1, dtype float32) ..."
    if cpu_library.load() is None:  # no C kernels here (e.g. AVX2 only): the job says so once, then the same lines
        assert lines.pop(1) == ("tpengine: CPU C kernels unavailable, using torch ops: "
                                f"{cpu_library.unavailable_reason()}"), lines[1]
    layouts, _, row_max = lines[1].partition("; greedy row max ")
    shapes = [s.split(" ")[0] for s in layouts.split("): ", 1)[1].split("; ")]
    layout = r"\d+->\d+ (plain|packed|blocked)[^;]*"  # (float32 has a blocked layout too)
    assert re.fullmatch(r"tpengine: CPU linear layouts \(float32, \d+ threads, [a-z, ()/:]+\): "
                        rf"{layout}(; {layout})*", layouts), lines[1]
    # the greedy pick, measured among the blocks dividing the 49152 columns (0: torch's max) and the C row
    # argmax (every build has one) (a measurement taken while the machine was busy, or noisy, says so and is
    # not cached: measured.py; on a machine busy before any timings were cached, the default, unmeasured)
    busy = (f"{'C' if cpu_library.load() else '512'} (default: machine busy, not measured)",)
    assert row_max in busy or re.fullmatch(r"(0|256|512|1024|2048|4096|C) \((measured|cached|measured, [a-z ]+ "
                                           r"\(not cached\)): "
                        r"0 \d+/\d+ us, 256 \d+/\d+ us, 512 \d+/\d+ us, 1024 \d+/\d+ us, 2048 \d+/\d+ us, "
                        r"4096 \d+/\d+ us" + (r", C \d+/\d+ us" if cpu_library.load() else "") + r"\)",
                        row_max), lines[1]
    assert shapes == ["64->64", "100->64", "64->128", "64->200", "64->49152"]  # the tiny Llama's weight shapes
    assert re.fullmatch(rf"tpengine: model ready: {re.escape(str(tiny))} float32 tp=1, weights 0\.\d\d GiB/rank, "
                        r"KV cache 40 blocks \(0\.\d\d GiB/rank, 512 B/token\), \d+\.\d s", lines[2]), lines[2]
    s = json.loads(summary.read_text())
    assert (s["requests_ok"], s["requests_error"], s["prompt_tokens"], s["output_tokens"]) == (2, 0, 2, 5)
    assert len(s["peak_rss_bytes"]) == 1 and s["peak_rss_bytes"][0] > 0
    assert len(out.read_text().splitlines()) == 2


def test_second_job_on_a_locked_out_at_tp2(tiny, tmp_path):
    """Rank 0 cannot take --out's lock: it says so once and exits 2; torchrun stops rank 1 at
    once; --out keeps what it held."""
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello", "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "old"}\n')
    t0 = time.monotonic()
    with OutputWriter(out, append=True):
        p = cli(["--prompts", prompts, "--model", tiny, "--out", out], tp=2, timeout=60, check=False, real=True)
    assert p.returncode != 0 and time.monotonic() - t0 < 60, p.stderr[-3000:]
    assert p.stderr.count(f"error: --out {str(out)!r} is locked by another job writing to it") == 1
    assert "exitcode  : 2" in p.stderr and "tpengine: loading" not in p.stderr
    assert out.read_text() == '{"id": "old"}\n'
    shutil.rmtree(tmp_path, ignore_errors=True)
