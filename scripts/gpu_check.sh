#!/usr/bin/env bash
# The GPU check: one script for a machine with one NVIDIA GPU, done within 8 minutes.
#
# usage: scripts/gpu_check.sh [OUT.json]          (default gpu-check.json)
#
#   1. setup     make setup model (skip with SKIP_SETUP=1, e.g. offline with a ready env)
#   2. pytest    tests/test_kernels.py + tests/test_triton_kernels.py + tests/test_gpu.py on CUDA, no Triton interpreter
#   3. agreement scripts/gpu_check.py: SmolLM2 tp=1 bf16 Triton + CUDA graphs vs Hugging Face,
#                16 prompts, argmax agreement >= 99% of generated positions
#   4. bench     python -m benchmarks.bench --dtype bfloat16 --tp 1 (if benchmarks/bench.py exists)
#
# Each step runs under `timeout`, capped by what is left of BUDGET_S (default 460 s), and the
# results (exit codes, seconds, test counts, the agreement and benchmark JSON, log tails of
# failed steps) go into one JSON file. Exit 0 when every step that ran passed.
# Environment: PYTHON (default .venv/bin/python), SKIP_SETUP, BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-gpu-check.json}")
BUDGET=${BUDGET_S:-460}
START=$(date +%s)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # real kernels on the GPU

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME MAX_S CMD...: run CMD under timeout min(MAX_S, time left); NAME.{rc,s,log} in $WORK
step() {
  local name=$1 max=$2 t t0
  shift 2
  t=$(left)
  ((t > max)) && t=$max
  if ((t < 15)); then
    echo "not run: time budget spent" >"$WORK/$name.log"
    echo 124 >"$WORK/$name.rc"
    echo 0 >"$WORK/$name.s"
  else
    t0=$(date +%s)
    timeout -k 10 "$t" "$@" >"$WORK/$name.log" 2>&1
    echo $? >"$WORK/$name.rc"
    echo $(($(date +%s) - t0)) >"$WORK/$name.s"
  fi
  echo "[gpu_check] $name: exit $(cat "$WORK/$name.rc") after $(cat "$WORK/$name.s") s" >&2
}

if [[ -z ${SKIP_SETUP:-} ]]; then
  step setup 120 make setup model
fi
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3

step env 60 "$PY" -c '
import json, torch, transformers
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = None
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "triton": tv,
                  "transformers": transformers.__version__, "cuda_available": cuda,
                  "gpu": torch.cuda.get_device_name(0) if cuda else None,
                  "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None}))'

step pytest 240 "$PY" -m pytest -q -rfEs -p no:cacheprovider --junitxml="$WORK/junit.xml" \
  tests/test_kernels.py tests/test_triton_kernels.py tests/test_gpu.py

step agreement 120 "$PY" scripts/gpu_check.py --out "$WORK/agreement.json"

if [[ -f benchmarks/bench.py ]]; then
  BENCH_ARGS=(--out "$WORK/bench.json")
  BENCH_HELP=$("$PY" -m benchmarks.bench --help 2>/dev/null)
  grep -q -- "--dtype" <<<"$BENCH_HELP" && BENCH_ARGS+=(--dtype bfloat16)
  grep -q -- "--tp" <<<"$BENCH_HELP" && BENCH_ARGS+=(--tp 1)  # one GPU
  step bench 120 "$PY" -m benchmarks.bench "${BENCH_ARGS[@]}"
fi

# one JSON with everything
"$PY" - "$WORK" "$OUT" "$START" "$BUDGET" <<'EOF'
import json, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, start, budget = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def read(name, default=None):
    p = work / name
    return p.read_text() if p.is_file() else default


def load(name):
    try:
        return json.loads(read(name, "null"))
    except json.JSONDecodeError:
        return None


steps = {}
for name in ("setup", "env", "pytest", "agreement", "bench"):
    if read(f"{name}.rc") is None:
        steps[name] = {"ran": False}
        continue
    rc = int(read(f"{name}.rc").strip())
    s = {"ran": True, "exit_code": rc, "seconds": int(read(f"{name}.s", "0").strip()), "timed_out": rc in (124, 137)}
    if rc != 0:
        s["log_tail"] = read(f"{name}.log", "")[-4000:]
    steps[name] = s

env = None
if steps["env"].get("exit_code") == 0:
    try:
        env = json.loads(read("env.log").strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        pass
if (work / "junit.xml").is_file():
    root = ET.parse(work / "junit.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    steps["pytest"].update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    steps["pytest"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                 if c.find("failure") is not None or c.find("error") is not None]
    steps["pytest"]["skipped_tests"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                        if c.find("skipped") is not None]
steps["agreement"]["result"] = load("agreement.json")
if steps["bench"]["ran"]:
    steps["bench"]["result"] = load("bench.json")
else:
    steps["bench"]["note"] = "benchmarks/bench.py not found"

ran = [s for s in steps.values() if s["ran"]]
ok = (bool(env and env.get("cuda_available")) and all(s["exit_code"] == 0 for s in ran)
      and steps["pytest"].get("ran", False) and steps["pytest"].get("skipped", 1) == 0)
report = {"ok": ok, "started_unix": start, "wall_s": int(time.time()) - start, "budget_s": budget,
          "env": env, "steps": steps}
out.write_text(json.dumps(report, indent=2))
agr = steps["agreement"]["result"] or {}
print(f"[gpu_check] ok={ok} wall={report['wall_s']}s pytest={steps['pytest'].get('tests')} tests, "
      f"{steps['pytest'].get('failures')} failed, {steps['pytest'].get('skipped')} skipped; "
      f"argmax agreement={agr.get('argmax_agreement')}; written to {out}", file=sys.stderr)
sys.exit(0 if ok else 1)
EOF
