"""Settings that fit the command line but not the model (its own length, the KV budget) are found
after the job starts, and are still a user's mistake: one line, exit 2, no traceback."""

from launch import cli
from test_cli import write_jsonl


def test_settings_that_do_not_fit_the_model_are_one_line_and_exit_2(tiny, tmp_path):
    """Found only once the model's length (max_position_embeddings 512) or the KV budget is known:
    still a user's mistake, one line naming the values, exit 2, no traceback."""
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello", "max_tokens": 2}])
    p = cli(["--prompts", prompts, "--model", tiny, "--no-enable-chunked-prefill", "--max-num-batched-tokens", 256],
            check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert ("invalid max_num_batched_tokens=256: must be >= max_model_len (512) without enable_chunked_prefill "
            "(a prompt is then prefilled in one step) (max_model_len taken from the model's "
            "max_position_embeddings; pass --max-model-len to choose it)") in p.stderr
    p = cli(["--prompts", prompts, "--model", tiny, "--kv-cache-gb", 0.0001], check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "failed: UserError: KV cache budget gives" in p.stderr and "max_model_len=512" in p.stderr
    p = cli(["--prompts", prompts, "--model", tiny, "--kv-cache-gb", 10**6], check=False)  # more than can be mapped
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "failed: UserError: cannot allocate the KV cache (" in p.stderr and "lower --kv-cache-gb (now 1000000" \
        in p.stderr


def run_command():
    """The click command of ``tpengine run``."""
    import typer

    from tpengine.entrypoints.cli import app

    return typer.main.get_command(app).commands["run"]


def test_every_engine_setting_has_a_flag_and_every_option_help_and_default():
    """One flag per EngineConfig field, named as vLLM names it; every option of ``tpengine run``
    has help text and shows its default; the console script is declared."""
    import tomllib
    from dataclasses import fields

    from conftest import REPO

    from tpengine.config import EngineConfig

    cmd = run_command()
    flags = {o: p for p in cmd.params for o in p.opts}
    for f in fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    for name in ("--gpu-memory-utilization", "--attention-backend", "--enforce-eager", "--kv-mirror",
                 "--cpu-kernels", "--dist-timeout-s", "--seed", "--num-kv-blocks", "--summary-json"):
        assert name in flags, name
    for name in ("--enforce-eager", "--kv-mirror", "--cpu-kernels", "--enable-prefix-caching"):
        assert flags[name].secondary_opts == ["--no-" + name[2:]], name
    for p in cmd.params:
        assert p.help, p.opts
        if p.name != "prompts":  # required
            assert p.show_default, p.opts
    help_text = cmd.get_help(cmd.make_context("tpengine run", ["--prompts", "x"]))
    assert "[default: (0.85)]" in help_text and "[default: (kv-mirror)]" in help_text
    assert "[default: (no-enforce-eager)]" in help_text and "[default: (16)]" in help_text
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tpengine"] == "tpengine.entrypoints.cli:app"


def test_engine_flags_reach_engine_config(tmp_path, monkeypatch):
    """Each new flag sets its field; a flag not given leaves the config file's value (then the
    default); ``python -m tpengine.run`` takes the same options as ``tpengine run``."""
    from typer.testing import CliRunner

    import tpengine.entrypoints.run as run
    from tpengine.entrypoints.cli import app

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    (tmp_path / "c.toml").write_text('[engine]\nblock_size = 8\nseed = 5\n[sampling]\ntemperature = 0.0\n')
    seen = []
    monkeypatch.setattr(run, "run_engine", lambda job: seen.append(job) or 0)
    args = ["--prompts", prompts, "--model", model, "--config", tmp_path / "c.toml", "--out", tmp_path / "o.jsonl",
            "--gpu-memory-utilization", "0.5", "--attention-backend", "torch", "--enforce-eager", "--no-kv-mirror",
            "--no-cpu-kernels", "--dist-timeout-s", "5", "--seed", "3", "--num-kv-blocks", "7"]
    r = CliRunner().invoke(app, ["run", *map(str, args)])
    assert r.exit_code == 0, r.output
    c = seen[0].config
    assert (c.gpu_memory_utilization, c.attention_backend, c.enforce_eager, c.kv_mirror, c.cpu_kernels,
            c.dist_timeout_s, c.seed, c.num_kv_blocks, c.block_size, c.max_num_seqs) == (
        0.5, "torch", True, False, False, 5.0, 3, 7, 8, 64)
    assert next(iter(seen[0].requests)).params.temperature == 0.0
    seen[0].close()
    r = CliRunner().invoke(run.app, list(map(str, args[:8])))  # python -m tpengine.run: the same command
    assert r.exit_code == 0, r.output
    assert (seen[1].config.seed, seen[1].config.block_size, seen[1].config.kv_mirror) == (5, 8, True)
    seen[1].close()


def test_serve_has_every_engine_flag_and_every_option_help_and_default():
    """``tpengine serve`` takes the same engine flags as ``tpengine run``, plus its own options, each
    with help text and its default shown."""
    import typer

    from tpengine.entrypoints.cli import app

    commands = typer.main.get_command(app).commands
    serve, run = commands["serve"], commands["run"]
    engine_flags = {o for p in run.params if p.name not in {"prompts", "out", "resume", "skip_invalid",
                                                             "summary_json", "max_tokens", "temperature"}
                    for o in p.opts}
    serve_flags = {o for p in serve.params for o in p.opts}
    assert engine_flags <= serve_flags
    assert {"--host", "--port", "--served-model-name", "--drain-timeout-s", "--config"} <= serve_flags
    for p in serve.params:
        assert p.help and p.show_default, p.opts
