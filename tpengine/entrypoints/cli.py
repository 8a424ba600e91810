"""``tpengine``: the command-line entry point (console script ``tpengine = "tpengine.entrypoints.cli:app"``).

    tpengine run --prompts file.jsonl --out out.jsonl
    tpengine serve --model DIR --port 8000
    torchrun --nproc_per_node=2 -m tpengine.entrypoints.cli run --prompts file.jsonl

``tpengine run`` is :func:`tpengine.entrypoints.run.main` (also ``python -m tpengine.run``); ``tpengine serve``
is :func:`tpengine.entrypoints.serve.main` (also ``python -m tpengine.entrypoints.serve``). Exit codes:
0 the job ran, 2 a user's mistake (one ``error:`` line), 1 an internal failure.
"""

from __future__ import annotations

import typer

from tpengine.startup import collector_paused, run_main

with collector_paused():  # the start's imports (tpengine/startup.py)
    from tpengine.entrypoints import run, serve

app = typer.Typer(
    name="tpengine",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="A small tensor-parallel inference engine for Hugging Face decoder LLMs.",
)


@app.callback()
def main() -> None:
    """A small tensor-parallel inference engine for Hugging Face decoder LLMs."""


app.command("run")(run.main)
app.command("serve")(serve.main)

if __name__ == "__main__":
    run_main(app)  # leaves without the interpreter's teardown (tpengine/startup.py)
