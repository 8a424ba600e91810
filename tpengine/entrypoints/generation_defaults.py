"""Sampling defaults from a model's ``generation_config.json`` (vLLM's ``generation_config="auto"``).

The keys taken, as ``SamplingParams`` fields: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, and ``max_new_tokens`` as ``max_tokens``; an explicit ``"do_sample":
false`` means greedy (``temperature`` 0, as HF ``generate``). Only keys the file sets are taken
(as vLLM: HF's own fallbacks such as ``top_k`` 50 are not). Precedence of a request's sampling
values, highest first: the request's field, a CLI flag, the config file's ``[sampling]`` table,
these defaults, tpengine's built-in ones (:class:`tpengine.sampling_params.SamplingParams`
and the per-format ``max_tokens``). The setting (``--generation-config``,
``EngineConfig.generation_config``): "auto" (the model folder's file, if any), "ignore"
(built-in defaults only) or a folder holding a ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tpengine.errors import UserError
from tpengine.sampling_params import SamplingParams

GENERATION_CONFIG = "generation_config.json"
#: ``generation_config.json`` key -> the SamplingParams field it is the default of, in the order
#: the printed line lists them.
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
#: The values of the setting besides a folder.
AUTO, IGNORE = "auto", "ignore"


def generation_config_file(setting: str, model_dir: str | Path) -> Path | None:
    """The ``generation_config.json`` that ``setting`` names for the model folder ``model_dir``:
    "auto": the model folder's (None when it has none); "ignore": None; else ``setting`` is a
    folder that must hold one.

    Raises:
        UserError: a folder that does not exist or holds no ``generation_config.json``.
    """
    if setting == IGNORE:
        return None
    if setting == AUTO:
        p = Path(model_dir) / GENERATION_CONFIG
        return p if p.is_file() else None
    folder = Path(setting)
    if not folder.is_dir():
        raise UserError(f"--generation-config {setting!r}: must be auto, ignore or a folder holding a "
                        f"{GENERATION_CONFIG}; {setting!r} is not a folder")
    p = folder / GENERATION_CONFIG
    if not p.is_file():
        raise UserError(f"--generation-config {setting!r}: the folder holds no {GENERATION_CONFIG}")
    return p


def read_generation_defaults(path: str | Path) -> dict[str, Any]:
    """The SamplingParams defaults in the ``generation_config.json`` at ``path`` (see the module
    docstring); {} when it sets none. A key set to null counts as not set.

    Raises:
        UserError: the file is unreadable, not JSON or not an object, or a taken key has a value
            SamplingParams refuses (naming the file, the key, the value and what is valid).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, name in GENERATION_KEYS.items():
        v = data.get(key)
        if v is None:
            continue
        try:
            SamplingParams(**{name: v})
            if name == "top_k" and v < -1:
                raise ValueError(f"top_k must be >= -1 (0 or -1: disabled), got {v}")
        except (TypeError, ValueError) as e:
            raise UserError(f"{path}: invalid {key}={json.dumps(v)}: {e}") from None
        if name == "top_k" and v == -1:
            v = 0
        out[name] = float(v) if name in ("temperature", "top_p", "min_p", "repetition_penalty") else v
    do_sample = data.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise UserError(f"{path}: invalid do_sample={json.dumps(do_sample)}: must be true or false")
    if do_sample is False:
        out["temperature"] = 0.0
    return out


def generation_defaults(setting: str, model_dir: str | Path) -> tuple[Path | None, dict[str, Any]]:
    """(the file read or None, its SamplingParams defaults) for ``setting`` and ``model_dir``
    (:func:`generation_config_file`, :func:`read_generation_defaults`). Raises UserError as they do."""
    path = generation_config_file(setting, model_dir)
    return path, ({} if path is None else read_generation_defaults(path))


def defaults_line(path: Path | None, defaults: dict[str, Any]) -> str | None:
    """The line rank 0 prints naming the defaults taken from the model, or None when none were:
    ``tpengine: sampling defaults from <path>: repetition_penalty=1.3 (--generation-config ignore
    to use tpengine's own)``."""
    if path is None or not defaults:
        return None
    order = [n for n in GENERATION_KEYS.values() if n in defaults]
    values = ", ".join(f"{n}={defaults[n]}" for n in order)
    return f"tpengine: sampling defaults from {path}: {values} (--generation-config ignore to use tpengine's own)"


def merge_defaults(model: dict[str, Any], config_table: dict[str, Any], cli: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams defaults by precedence: ``cli`` (None values skipped) over the config file's
    ``[sampling]`` table over the ``model``'s generation_config.json defaults."""
    return {**model, **config_table, **{k: v for k, v in cli.items() if v is not None}}
