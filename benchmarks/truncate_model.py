"""A weak draft model for speculative decoding: the first layers of a model and its head (issue 39).

    python -m benchmarks.truncate_model --layers 6 --out models/smollm2-135m-instruct-6l

No smaller model with SmolLM2's vocabulary ships offline, so ``make bench-spec`` builds this one: the
embedding, the first ``--layers`` decoder layers, the final norm and the LM head of ``--model``
(tensors copied unchanged), with ``num_hidden_layers`` set in its ``config.json`` and the tokenizer
and generation files copied. It shares the model's vocabulary, so the engine accepts it as a draft.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Annotated

import typer

from tpengine.config import DEFAULT_MODEL_DIR

#: Files copied as they are (tokenizer, chat template, sampling defaults).
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncate(model: Path, layers: int, out: Path) -> Path:
    """Write ``out``: ``model``'s first ``layers`` decoder layers with its embedding, norm and head.

    Raises:
        ValueError: ``layers`` not in ``[1, num_hidden_layers]``, or a folder without ``config.json``
            and ``*.safetensors``.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg_path = model / "config.json"
    files = sorted(model.glob("*.safetensors"))
    if not cfg_path.is_file() or not files:
        raise ValueError(f"{model}: need a config.json and *.safetensors")
    config = json.loads(cfg_path.read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers {layers}: must be in [1, {config['num_hidden_layers']}]")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                m = LAYER.match(name)
                if m is None or int(m.group(1)) < layers:
                    tensors[name] = st.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2) + "\n")
    for name in COPIED:
        if (model / name).is_file():
            shutil.copy2(model / name, out / name)
    return out


def main(model: Annotated[Path, typer.Option(help="the full model folder")] = Path(DEFAULT_MODEL_DIR),
         layers: Annotated[int, typer.Option(help="decoder layers kept (the first ones)")] = 6,
         out: Annotated[Path, typer.Option(help="the draft model folder to write")] = None) -> None:
    """Write the truncated copy and say where."""
    out = out or model.with_name(f"{model.name}-{layers}l")
    try:
        truncate(model, layers, out)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    print(f"wrote {out} ({layers} layers)")


if __name__ == "__main__":
    typer.run(main)
