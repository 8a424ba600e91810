"""``tpengine-shard``: convert (GGUF -> HF folder), split (HF folder -> per-rank safetensors +
manifest), verify (hashes, names, shapes), info (the ShardPlan of a config)."""

from __future__ import annotations

import typer

from tpengine.startup import collector_paused

with collector_paused():  # the start's imports (tpengine/startup.py)
    from shard_tool import convert, info, split, verify

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Make and check per-rank tensor-parallel checkpoints for tpengine.",
)


@app.callback()
def main() -> None:
    """Make and check per-rank tensor-parallel checkpoints for tpengine."""


app.command("convert")(convert.convert)
app.command("split")(split.split)
app.command("verify")(verify.verify)
app.command("info")(info.info)

if __name__ == "__main__":
    app()
