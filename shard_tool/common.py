"""Helpers shared by the ``tpengine-shard`` commands: user errors, atomic output folders,
hashing, and which checkpoint files are weights.

A user's mistake is a :class:`tpengine.errors.UserError` (re-exported here as ``UserError``), the
same type the main job uses; :func:`user_errors` turns it into one ``error:`` line. Any other
exception is a failure of the tool and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import typer

from tpengine.errors import UserError
from tpengine.model.checkpoint import check_model_folder, read_json_file

# Files that hold weights (never copied as "side files" by split).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
SKIP_FILES = {"model.safetensors.index.json", "pytorch_model.bin.index.json", "manifest.json"}


#: Exit code of ``tpengine-shard`` for a user's mistake, as ``tpengine.entrypoints.run``'s (1 is a failure:
#: an internal error, or ``verify`` finding a corrupt shard).
USER_ERROR_EXIT = 2


def fail(message: str, code: int = USER_ERROR_EXIT) -> NoReturn:
    """Print ``message`` as one line on stderr and exit with ``code`` (no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a :class:`UserError` raised inside the block, a ``FileNotFoundError`` (a path the
    user gave, or a file a checkpoint it names, does not exist) or a ``PermissionError`` (a place
    the user may not write to) into :func:`fail`: one line on stderr, exit code
    :data:`USER_ERROR_EXIT`. Anything else propagates (a traceback)."""
    try:
        yield
    except (UserError, FileNotFoundError) as e:
        fail(str(e))
    except PermissionError as e:  # a place the user cannot write to (or read from)
        fail(f"{e.strerror}: {str(e.filename)!r}")


@contextlib.contextmanager
def atomic_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a fresh ``<out>.tmp`` folder to write into; on success rename it to ``out``.

    A run killed or failing half way leaves ``out`` untouched (the ``.tmp`` folder is removed on
    error and replaced by the next run). Before the rename, every file and folder inside gets the
    usual mode for a new one (``0o666`` / ``0o777`` less the umask, as ``open()`` and ``mkdir``
    give it): writers that go through a private temporary file (safetensors' ``save_file``)
    leave 0600 behind.

    Raises:
        UserError: ``out`` already exists and ``force`` is false, or ``<out>.tmp`` cannot be
            made (a folder the user may not write to, a read-only file system: naming it).
    """
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"output folder {str(out)!r} already exists; remove it or pass --force")
    tmp = out.with_name(out.name + ".tmp")
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"cannot create output folder {str(tmp)!r} (written, then renamed to {str(out)!r}): "
                        f"{e.strerror or e}") from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    set_default_modes(tmp)
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def current_umask() -> int:
    """This process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def set_default_modes(folder: Path) -> None:
    """Give ``folder`` and everything below it the modes new files and folders get by default:
    ``0o777 & ~umask`` for folders, ``0o666 & ~umask`` for files (symlinks are left alone)."""
    mask = current_umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    os.chmod(folder, dir_mode)
    for root, dirs, files in os.walk(folder):
        for names, mode in ((dirs, dir_mode), (files, file_mode)):
            for name in names:
                p = os.path.join(root, name)
                if not os.path.islink(p):
                    os.chmod(p, mode)


def side_files(model_dir: Path) -> list[Path]:
    """Top-level non-weight files of a HF model folder (config, generation config, tokenizer
    files, chat template, ...), sorted by name."""
    return sorted(
        p
        for p in Path(model_dir).iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and not p.name.endswith(WEIGHT_SUFFIXES)
        and p.name not in SKIP_FILES
    )


def read_json(path: Path, what: str) -> dict:
    """Parse the JSON object in the file ``path`` (:func:`tpengine.model.checkpoint.read_json_file`).

    Raises:
        UserError: the file is missing, unreadable, not valid JSON or not an object (naming
            ``what`` and the path).
    """
    return read_json_file(path, what)


def read_model_config(model_dir: Path):
    """The transformers config of the model folder ``model_dir``, read only after
    :func:`tpengine.model.checkpoint.check_model_folder` has found its ``config.json`` (and any
    ``manifest.json``) readable.

    Raises:
        UserError: no ``config.json`` in ``model_dir`` (or no such folder), a broken one or a
            broken ``manifest.json``, or one transformers cannot read (naming the file).
    """
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{str(model_dir)!r} is not a model folder: it has no config.json")
    check_model_folder(model_dir)
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as e:  # e.g. a model_type transformers does not know
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model config {str(model_dir / 'config.json')!r} cannot be read by transformers: "
                        f"{first}") from None
