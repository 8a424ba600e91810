"""Chaos trials (issue 38): SIGKILL or SIGSTOP a rank or the launcher of a tp=2 job or server at a random
time, then check that the job's processes end, its ``--out`` stays whole and ``--resume`` completes it,
or that the server ends and serves again after a restart.

    python -m benchmarks.chaos                      (make chaos: 20 trials on a tiny random model)
    python -m benchmarks.chaos --trials 3 --seed 1 --out chaos.json
    python -m benchmarks.chaos --model models/smollm2-135m-instruct

Each trial draws (seeded) a target (the batch job ``torchrun --nproc_per_node=2 -m tpengine.run`` or
the server ``torchrun --nproc_per_node=2 -m tpengine.serve`` under a few concurrent streaming and
non-streaming clients), an action (``kill``: SIGKILL; ``stop``: SIGSTOP), a victim (rank 0, rank 1 or
the launcher, torchrun) and a time (a job's: one in three during start-up, the others while records are
written, as timed on a clean run made first; a server's: 0.5-4 s into its load). The twelve combinations
are drawn in shuffled rounds, so 12 trials cover every one. A trial passes when:

- processes: every process of the launched tree (torchrun and every descendant ever seen) is gone
  within ``--dist-timeout-s`` + 10 s of the fault. A stopped launcher is a pause, not a fault: it is
  resumed (SIGCONT) after ``--dist-timeout-s`` + 2 s, and the job must then finish with exit 0 (the
  server: serve a request and stop on SIGTERM to its ranks), its processes gone within the same
  window of that end. Whatever is left at the deadline is a failure: it is listed (role, pid, state),
  then sent SIGCONT and SIGKILL so nothing leaks into the next trial;
- job, out: every complete line of ``--out`` is a JSON object with an ``id``, no id twice, no error
  record; a torn last line (no newline) is accepted, since ``--resume`` cuts it off
  (``tpengine.frontend.writer.read_done``);
- job, resume: ``--resume`` on that file exits 0 and leaves every id exactly once, every line whole;
- server, out: every client request ended (answered, or failed with a connection error or a 5xx)
  by the deadline: no client hangs on a dead server;
- server, restart: a new server on the same port answers a completion with 200, then stops cleanly.

Prints one row per trial and exits 1 when any trial failed. Known: a rank stopped with SIGSTOP is ended
only by torchrun's SIGKILL after its 30 s grace (docs/notes/readme-details.md, "Hang forensics"), which
is beyond the window; such trials fail and say so.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import REPO_ROOT, emit, launcher, subprocess_env
from benchmarks.bench_serve import free_port
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)

#: Engine flags of every launch: a small cache and context, so a tiny model's job and server start fast.
ENGINE_ARGS = ["--max-model-len", "256", "--kv-cache-gb", "0.02", "--max-num-seqs", "4"]
#: The tiny model's shape: SmolLM2's vocabulary (its tokenizer is copied in, so text prompts work).
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
COMBOS = [(t, a, v) for t in ("job", "server") for a in ("kill", "stop") for v in ("rank0", "rank1", "launcher")]


def default_model_dir() -> Path:
    """The default model folder (``models/smollm2-135m-instruct``), relative to the repository root."""
    p = Path(DEFAULT_MODEL_DIR)
    return p if p.is_absolute() else REPO_ROOT / p


def build_tiny_model(folder: Path, tokenizer_dir: Path | None = None, seed: int = 0) -> Path:
    """Write a random-weight float32 Llama of :data:`TINY_SHAPE` to ``folder`` (about 13 MB) with the
    tokenizer files of ``tokenizer_dir`` (default: the default model's) and its vocabulary size, and
    return ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tokenizer_dir or default_model_dir()
    src_config = json.loads((src / "config.json").read_text())
    config = LlamaConfig(**TINY_SHAPE, vocab_size=src_config["vocab_size"],
                         bos_token_id=src_config.get("bos_token_id"), eos_token_id=src_config.get("eos_token_id"))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


# ---------------------------------------------------------------------------------------------------------
# processes


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks) of ``pid`` from ``/proc/<pid>/stat``, None if gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return f[0], int(f[1]), int(f[19])
    except (OSError, IndexError, ValueError):
        return None


def proc_rank(pid: int) -> int | None:
    """torchrun's ``RANK`` in ``pid``'s environment, None without one."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")), None)


class Tree:
    """Every process ever seen under a launcher (the launcher and its descendants), each kept with its
    start time so a reused pid is never mistaken for it; ``poll`` adds the new ones. torchrun starts each
    rank in a session of its own, so the tree is followed by parent pid, not by session."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.others_gone: float | None = None  # set by wait_gone
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start ticks, role)
        self.poll()

    def poll(self) -> None:
        """Add the descendants of every live process of the tree."""
        stats = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (s := proc_stat(int(entry.name))) is not None:
                stats[int(entry.name)] = s
        if self.root not in self.seen and self.root in stats:
            self.seen[self.root] = (stats[self.root][2], "launcher")
        changed = True
        while changed:
            changed = False
            for pid, (_, ppid, start) in stats.items():
                if pid not in self.seen and ppid in self.seen and self.alive(ppid):
                    rank = proc_rank(pid) if ppid == self.root else None
                    self.seen[pid] = (start, f"rank{rank}" if rank is not None else "child")
                    changed = True
        # a rank caught between the launcher's fork and its exec still has the launcher's environment
        # (no RANK): look again until it has one, or it would never be found as a rank
        for pid, (start, role) in list(self.seen.items()):
            if role == "child" and pid in stats and stats[pid][1] == self.root and stats[pid][2] == start:
                if (rank := proc_rank(pid)) is not None:
                    self.seen[pid] = (start, f"rank{rank}")

    def state(self, pid: int) -> str | None:
        """``pid``'s state letter while it is the process seen (not a zombie), else None."""
        s = proc_stat(pid)
        if s is None or s[0] in "ZX" or s[2] != self.seen[pid][0]:
            return None
        return s[0]

    def alive(self, pid: int) -> bool:
        """``pid`` is the process seen and not a zombie."""
        return self.state(pid) is not None

    def live(self) -> list[tuple[str, int, str]]:
        """(role, pid, state) of every process of the tree still running."""
        return [(role, pid, st) for pid, (_, role) in self.seen.items() if (st := self.state(pid)) is not None]

    def pid_of(self, role: str) -> int | None:
        """The live process of ``role`` ("launcher", "rank0", ...), None if there is none."""
        self.poll()
        return next((pid for pid, (_, r) in self.seen.items() if r == role and self.alive(pid)), None)

    def wait_gone(self, deadline: float, step: float = 0.1, but: tuple[int, ...] = ()) -> float | None:
        """Poll until no process of the tree runs or ``deadline`` (monotonic): when the last one ended,
        None if some still run. ``others_gone`` becomes when every process but the pids ``but`` ended."""
        self.others_gone = None
        while True:
            self.poll()
            live = self.live()
            if self.others_gone is None and all(pid in but for _, pid, _ in live):
                self.others_gone = time.monotonic()
            if not live:
                return time.monotonic()
            if time.monotonic() >= deadline:
                return None
            time.sleep(step)

    def reap(self) -> list[str]:
        """SIGCONT then SIGKILL every live process of the tree; their ``role:pid(state)`` descriptions."""
        left = self.live()
        for _, pid, _ in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        return [f"{role}:{pid}({st})" for role, pid, st in left]


def send(pid: int, sig: signal.Signals) -> None:
    """``kill(pid, sig)``, ignoring a process already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------------------
# the batch job


def write_prompts(path: Path, n: int, max_tokens: int) -> list[str]:
    """``n`` greedy ``prompt_token_ids`` requests of ``max_tokens`` tokens each (``ignore_eos``); their ids."""
    ids = [f"r{i}" for i in range(n)]
    with open(path, "w") as fh:
        for i, rid in enumerate(ids):
            fh.write(json.dumps({"id": rid, "prompt_token_ids": [5, 6, 7, 10 + i], "max_tokens": max_tokens,
                                 "temperature": 0, "ignore_eos": True}) + "\n")
    return ids


def check_out(path: Path, final: bool) -> tuple[bool, str, set[str]]:
    """Whether ``path`` holds only whole, distinct, successful records: (ok, why not, ids). A torn last
    line is accepted unless ``final`` (after ``--resume``, which cuts it off, none may be left)."""
    data = path.read_bytes() if path.exists() else b""
    end = data.rfind(b"\n") + 1
    torn = end < len(data)
    ids: set[str] = set()
    for n, line in enumerate(data[:end].splitlines(), 1):
        try:
            rec = json.loads(line)
        except ValueError:
            return False, f"line {n} is not JSON: {line[:80]!r}", ids
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            return False, f"line {n} has no id", ids
        if rec["id"] in ids:
            return False, f"id {rec['id']!r} twice (line {n})", ids
        if "error" in rec:
            return False, f"line {n} is an error record: {str(rec['error'])[:120]}", ids
        ids.add(rec["id"])
    if torn and final:
        return False, "a torn last line after --resume", ids
    return True, "torn last line" if torn else "", ids


# ---------------------------------------------------------------------------------------------------------
# the server's clients


class Clients:
    """``n`` concurrent clients in a thread of their own, each sending completions in a loop (streaming and
    not, alternately) until :meth:`stop`; counts the requests answered and those that failed (a refused
    or reset connection, a 5xx, a stream cut off), and which are still in flight."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.answered = self.failed = self.in_flight = 0
        self.name = "m"
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()

    async def _one(self, session, k: int) -> None:
        import aiohttp

        stream = k % 2 == 0
        body = {"model": self.name, "prompt": f"Count to ten, client {k}:", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        self.in_flight += 1
        try:
            async with session.post(self.url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
                if stream:
                    done = False
                    async for raw in resp.content:
                        if raw.strip() == b"data: [DONE]":
                            done = True
                    if not done:
                        raise RuntimeError("stream ended without [DONE]")
                else:
                    await resp.json()
            self.answered += 1
        except (aiohttp.ClientError, RuntimeError, asyncio.TimeoutError, ValueError) as e:
            self.failed += 1
            if len(self.errors) < 5:
                self.errors.append(f"{type(e).__name__}: {e}"[:120])
            await asyncio.sleep(0.2)  # a dead server refuses at once: do not spin
        finally:
            self.in_flight -= 1

    async def _main(self) -> None:
        import aiohttp

        async def loop(k: int) -> None:
            while not self._stop.is_set():
                await self._one(session, k)

        # the model name is read from /v1/models so the requests are not 404s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            try:
                async with session.get(self.url + "/v1/models") as resp:
                    name = (await resp.json())["data"][0]["id"]
            except (aiohttp.ClientError, KeyError, ValueError):
                name = "m"
            self.name = name
            await asyncio.gather(*(loop(k) for k in range(self.n)))

    def stop(self, timeout: float) -> bool:
        """Ask every client to stop after its request; True if all ended within ``timeout`` s."""
        self._stop.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()


def http_ok(url: str, body: dict | None = None, timeout: float = 5.0) -> bool:
    """GET (or POST ``body`` as JSON to) ``url``: whether it answered 200."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def served_name(base: str) -> str:
    """The served model's name from ``/v1/models``."""
    with urllib.request.urlopen(base + "/v1/models", timeout=5) as resp:
        return json.loads(resp.read())["data"][0]["id"]


# ---------------------------------------------------------------------------------------------------------
# trials


@dataclass
class Trial:
    """One trial's draw and outcome (a row of the table)."""

    trial: int
    target: str
    action: str
    victim: str
    at_s: float | None = None
    ended_s: float | None = None
    leftover: list[str] = field(default_factory=list)
    out_ok: bool | None = None
    after_ok: bool | None = None  # --resume (job) or restart (server)
    detail: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No leftover process and every check passed."""
        return not self.leftover and self.out_ok is True and self.after_ok is True and self.ended_s is not None


@dataclass
class Setup:
    """What every trial shares."""

    model: Path
    tmp: Path
    dist_timeout_s: float
    prompts: Path
    ids: list[str]
    job_s: float  # the clean job's wall time: faults land within it
    engine_args: list[str]
    clients: int
    max_tokens: int
    launch_timeout_s: float = 300.0
    first_record_s: float | None = None  # when the clean job wrote its first record

    @property
    def window_s(self) -> float:
        return self.dist_timeout_s + 10.0


def job_cmd(s: Setup, out: Path, resume: bool = False) -> list[str]:
    """The tp=2 batch job on the trial prompts."""
    return [*launcher(2, "tpengine.run"), "--prompts", str(s.prompts),
            "--out", str(out), "--model", str(s.model), *s.engine_args, "--dist-timeout-s", str(s.dist_timeout_s),
            *(["--resume"] if resume else [])]


def serve_cmd(s: Setup, port: int) -> list[str]:
    """The tp=2 server on 127.0.0.1:``port``."""
    return [*launcher(2, "tpengine.serve"), "--host", "127.0.0.1",
            "--port", str(port), "--model", str(s.model), *s.engine_args, "--dist-timeout-s", str(s.dist_timeout_s)]


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    """``cmd`` in a session of its own, stdout discarded, stderr appended to ``log``."""
    with open(log, "a") as err:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)


def wait_until(t: float, tree: Tree, proc: subprocess.Popen) -> bool:
    """Poll the tree until monotonic ``t``; False if the launcher ended first."""
    while time.monotonic() < t:
        tree.poll()
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return True


def victim_pid(tree: Tree, victim: str, proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """The victim's pid (waiting up to ``timeout`` s for a rank to be started), None if the job ended."""
    if victim == "launcher":
        return proc.pid
    deadline = time.monotonic() + timeout
    while (pid := tree.pid_of(victim)) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return pid


def finish_processes(t: Trial, tree: Tree, proc: subprocess.Popen, since: float, window: float,
                     victim: int | None = None) -> None:
    """Wait for the tree to end within ``window`` s of ``since``; record the time and any leftover (then
    reaped), and reap the launcher. With a ``victim`` left, say when every other rank had ended."""
    ended = tree.wait_gone(since + window, but=(proc.pid,) if victim is None else (proc.pid, victim))
    t.ended_s = None if ended is None else round(ended - since, 2)
    t.leftover = tree.reap()
    if t.leftover:
        others = "" if tree.others_gone is None else \
            f" (every other rank had ended {tree.others_gone - since:.2f} s after the fault)"
        t.detail.append(f"left {window:.0f} s after the fault: {', '.join(t.leftover)}{others}")
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        send(proc.pid, signal.SIGKILL)
        proc.wait()


def job_trial(t: Trial, s: Setup, rng: random.Random) -> None:
    """One fault in the batch job, then its ``--out`` and a ``--resume``."""
    out, log = s.tmp / f"trial{t.trial}.jsonl", s.tmp / f"trial{t.trial}.log"
    proc = launch(job_cmd(s, out), log)
    t0 = time.monotonic()
    tree = Tree(proc.pid)
    # a third of the faults during start-up (before the clean job's first record), the rest while it writes
    first = s.first_record_s or s.job_s
    if rng.random() < 1 / 3:
        at = rng.uniform(0.5, max(1.0, first))
    else:
        at = rng.uniform(first, max(first + 0.5, 0.95 * s.job_s))
    pid = victim_pid(tree, t.victim, proc) if wait_until(t0 + at, tree, proc) else None
    if pid is None or proc.poll() is not None:
        t.detail.append("the job ended before the fault")
        fault = time.monotonic()
    else:
        sig = signal.SIGKILL if t.action == "kill" else signal.SIGSTOP
        send(pid, sig)
        fault = time.monotonic()
        t.at_s = round(fault - t0, 2)
    if t.action == "stop" and t.victim == "launcher" and t.at_s is not None:
        # a paused launcher: the ranks run on; resumed, the job must finish as if nothing happened
        wait_until(fault + s.dist_timeout_s + 2, tree, proc)
        send(pid, signal.SIGCONT)
        try:
            rc = proc.wait(s.job_s * 3 + 60)
            if rc != 0:
                t.detail.append(f"the job exited {rc} after its launcher was resumed")
        except subprocess.TimeoutExpired:
            t.detail.append("the job did not finish after its launcher was resumed")
    finish_processes(t, tree, proc, fault, s.window_s, victim=pid)
    ok, why, got = check_out(out, final=False)
    t.detail.append(f"{len(got)} of {len(s.ids)} records before --resume")
    t.out_ok = ok and not (t.action == "stop" and t.victim == "launcher" and "torn" in why)
    if why:
        t.detail.append(f"out: {why}")
    # --resume completes the rest, each id once
    log_resume = s.tmp / f"trial{t.trial}.resume.log"
    rproc = launch(job_cmd(s, out, resume=True), log_resume)
    rtree = Tree(rproc.pid)
    try:
        rc = rproc.wait(s.job_s * 3 + 120)
    except subprocess.TimeoutExpired:
        rc = None
    rtree.poll()
    if rtree.reap():
        t.detail.append("the --resume run hung or left processes")
        rproc.wait()
    ok, why, ids = check_out(out, final=True)
    t.after_ok = rc == 0 and ok and ids == set(s.ids)
    if not t.after_ok:
        t.detail.append(f"resume: exit {rc}, {why or ''} {len(ids)} of {len(s.ids)} ids "
                        f"(log {log_resume})".replace("  ", " "))


def start_server(s: Setup, port: int, log: Path) -> tuple[subprocess.Popen, Tree] | None:
    """A tp=2 server on ``port``, ready once ``/health`` answers 200; None if it did not come up (its tree
    reaped)."""
    proc = launch(serve_cmd(s, port), log)
    tree = Tree(proc.pid)
    deadline = time.monotonic() + s.launch_timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        tree.poll()
        if http_ok(f"http://127.0.0.1:{port}/health", timeout=2):
            tree.poll()
            return proc, tree
        time.sleep(0.3)
    tree.reap()
    proc.wait()
    return None


def stop_server(proc: subprocess.Popen, tree: Tree, timeout: float) -> bool:
    """SIGTERM to the server's ranks (a process manager's stop: rank 0 drains, every rank exits 0); whether
    the whole tree ended within ``timeout`` s (else it is reaped)."""
    tree.poll()
    for role in ("rank0", "rank1"):
        if (pid := tree.pid_of(role)) is not None:
            send(pid, signal.SIGTERM)
    gone = tree.wait_gone(time.monotonic() + timeout) is not None
    tree.reap()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        send(proc.pid, signal.SIGKILL)
        proc.wait()
    return gone


def server_trial(t: Trial, s: Setup, rng: random.Random) -> None:
    """One fault in a loaded server, then a restart that serves."""
    port, log = free_port(), s.tmp / f"trial{t.trial}.log"
    base = f"http://127.0.0.1:{port}"
    started = start_server(s, port, log)
    if started is None:
        t.detail.append(f"the server did not come up (log {log})")
        return
    proc, tree = started
    name = served_name(base)
    clients = Clients(base, s.clients, s.max_tokens)
    t0 = time.monotonic()
    at = rng.uniform(0.5, 4.0)
    wait_until(t0 + at, tree, proc)
    pid = victim_pid(tree, t.victim, proc, timeout=1)
    if pid is None:
        t.detail.append("the server ended before the fault")
        fault = time.monotonic()
    else:
        send(pid, signal.SIGKILL if t.action == "kill" else signal.SIGSTOP)
        fault = time.monotonic()
        t.at_s = round(fault - t0, 2)
    if t.action == "stop" and t.victim == "launcher" and pid is not None:
        # a paused launcher: the server serves on; resumed, it is stopped as a process manager would
        wait_until(fault + s.dist_timeout_s + 2, tree, proc)
        send(pid, signal.SIGCONT)
        if not http_ok(base + "/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 4}, timeout=30):
            t.detail.append("the server did not answer after its launcher was resumed")
            t.out_ok = False
        stop_at = time.monotonic()
        for role in ("rank0", "rank1"):
            if (rpid := tree.pid_of(role)) is not None:
                send(rpid, signal.SIGTERM)
        finish_processes(t, tree, proc, stop_at, s.window_s)
    else:
        finish_processes(t, tree, proc, fault, s.window_s, victim=pid)
    answered_before = clients.answered
    ended = clients.stop(timeout=10)
    if not ended:
        t.detail.append(f"{clients.in_flight} client request(s) still hanging after the server ended")
    t.detail.append(f"clients: {clients.answered} answered, {clients.failed} failed"
                    + (f" ({clients.errors[0]})" if clients.errors else ""))
    t.out_ok = ended and t.out_ok is not False and answered_before > 0
    # the restart serves again
    log2 = s.tmp / f"trial{t.trial}.restart.log"
    restarted = start_server(s, port, log2)
    if restarted is None:
        t.after_ok = False
        t.detail.append(f"the restarted server did not come up (log {log2})")
        return
    proc2, tree2 = restarted
    served = http_ok(base + "/v1/completions", {"model": name, "prompt": "Hello", "max_tokens": 8}, timeout=60)
    stopped = stop_server(proc2, tree2, s.window_s)
    t.after_ok = served and stopped
    if not t.after_ok:
        t.detail.append(f"restart: served {served}, stopped cleanly {stopped} (log {log2})")


def draw(trials: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """``trials`` (target, action, victim) draws: the twelve combinations in shuffled rounds."""
    out: list[tuple[str, str, str]] = []
    while len(out) < trials:
        round_ = COMBOS[:]
        rng.shuffle(round_)
        out += round_
    return out[:trials]


def render_table(trials: list[Trial]):
    """A ``rich.table.Table`` of the trials."""
    from rich.table import Table

    def yes(v: bool | None) -> str:
        return "-" if v is None else ("[green]yes[/]" if v else "[red]NO[/]")

    table = Table(title="chaos trials (tp=2)")
    for col in ("trial", "target", "action", "victim", "at s", "ended in s", "leftover processes", "out ok",
                "resume / restart ok", "verdict"):
        table.add_column(col, overflow="fold")
    for t in trials:
        table.add_row(str(t.trial), t.target, t.action, t.victim, "-" if t.at_s is None else f"{t.at_s:.2f}",
                      "-" if t.ended_s is None else f"{t.ended_s:.2f}", ", ".join(t.leftover) or "none",
                      yes(t.out_ok), yes(t.after_ok), "[green]pass[/]" if t.passed else "[red]FAIL[/]")
    return table


@app.command()
def main(
    trials: Annotated[int, typer.Option(help="number of trials")] = 20,
    seed: Annotated[int, typer.Option(help="seed of the draws (target, action, victim, time)")] = 0,
    dist_timeout_s: Annotated[float, typer.Option(help="--dist-timeout-s of every launch")] = 5.0,
    model: Annotated[Path | None, typer.Option(help="model folder (default: a tiny random model built in a "
                                                    "temporary folder)")] = None,
    requests: Annotated[int, typer.Option(help="requests of the batch job")] = 48,
    max_tokens: Annotated[int, typer.Option(help="output tokens per request")] = 64,
    clients: Annotated[int, typer.Option(help="concurrent clients of the server")] = 4,
    only: Annotated[list[str] | None, typer.Option(help="run only these draws, TARGET:ACTION:VICTIM (e.g. "
                                                        "job:stop:rank1; repeat the option)")] = None,
    keep: Annotated[bool, typer.Option(help="keep the temporary folder (logs, out files)")] = False,
    out: Annotated[Path | None, typer.Option(help="write the results as JSON here")] = None,
) -> None:
    """Kill or stop a rank or the launcher of a tp=2 job or server at random times; check what is left."""
    from rich.console import Console

    console = Console(width=max(Console().width, 160))
    tmp = Path(tempfile.mkdtemp(prefix="tpengine-chaos-"))
    try:
        if model is None:
            model = build_tiny_model(tmp / "tiny-model")
            console.print(f"model: a tiny random Llama in {model}")
        prompts = tmp / "prompts.jsonl"
        ids = write_prompts(prompts, requests, max_tokens)
        s = Setup(model=model, tmp=tmp, dist_timeout_s=dist_timeout_s, prompts=prompts, ids=ids, job_s=0.0,
                  engine_args=ENGINE_ARGS, clients=clients, max_tokens=max_tokens)
        # a warm-up run with a long timeout: a cold cache (the C kernels' build, the measured layouts) can
        # keep a rank from its first collective longer than a short --dist-timeout-s
        warm = Setup(**{**asdict(s), "dist_timeout_s": max(60.0, dist_timeout_s)})
        subprocess.run(job_cmd(warm, tmp / "warm.jsonl"), cwd=REPO_ROOT, env=subprocess_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # then a clean run: it must pass, and its times (first record, end) say when the job's faults land
        clean_out, clean_log = tmp / "clean.jsonl", tmp / "clean.log"
        t0 = time.monotonic()
        clean = launch(job_cmd(s, clean_out), clean_log)
        while clean.poll() is None and s.first_record_s is None:
            if clean_out.exists() and b"\n" in clean_out.read_bytes():
                s.first_record_s = time.monotonic() - t0
            time.sleep(0.05)
        clean.wait()
        s.job_s = time.monotonic() - t0
        ok, why, got = check_out(clean_out, final=True)
        if clean.returncode != 0 or not ok or got != set(ids):
            console.print(f"[red]the clean job failed (exit {clean.returncode}, {why}):[/]")
            console.print(clean_log.read_text()[-3000:], markup=False, highlight=False)
            raise typer.Exit(1)
        s.first_record_s = s.first_record_s or s.job_s
        console.print(f"clean job: {len(ids)} requests in {s.job_s:.1f} s, the first record after "
                      f"{s.first_record_s:.1f} s")
        rng = random.Random(seed)
        results = []
        draws = draw(trials, rng)
        if only:
            picked = [tuple(o.split(":")) for o in only]
            if bad := [o for o in picked if o not in COMBOS]:
                raise typer.BadParameter(f"--only: unknown draw(s) {bad}; valid: target job|server, action "
                                         "kill|stop, victim rank0|rank1|launcher")
            draws = [picked[i % len(picked)] for i in range(trials)]
        for i, (target, action, victim) in enumerate(draws, 1):
            t = Trial(i, target, action, victim)
            (job_trial if target == "job" else server_trial)(t, s, rng)
            results.append(t)
            console.print(f"trial {i}: {target} {action} {victim} at {t.at_s} s: "
                          f"{'pass' if t.passed else 'FAIL'}; {'; '.join(t.detail)}")
        result = {"trials": [{**asdict(t), "passed": t.passed} for t in results], "seed": seed,
                  "dist_timeout_s": dist_timeout_s, "model": str(model), "clean_job_s": round(s.job_s, 2),
                  "failed": sum(not t.passed for t in results)}
        emit(console, render_table(results), result, out)
        if result["failed"]:
            console.print(f"[red]{result['failed']} of {len(results)} trials failed[/]")
            raise typer.Exit(1)
    finally:
        if keep:
            console.print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    app()
