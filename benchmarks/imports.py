"""The package layering of ``tpengine``, read from the source: ``python -m benchmarks.imports``.

Every ``import`` of a ``tpengine`` module that runs (at module level or inside a function; an
``if TYPE_CHECKING:`` block is only read by type checkers and is left out) is an arrow from the
importing module's package to the imported one's. A package may import only the packages
:data:`MAY_IMPORT` lists for it, which also rules out any cycle between packages; the command prints
every package's arrows and each forbidden one, and exits 1 if there is any.

The packages, bottom up (docs/design.md, "The house"): ``structured`` (structured outputs: the
constraint, the grammar libraries, the bitmask; it imports no other layer), ``core`` (the modules at the package root:
``config``, ``errors``, ``utils``, ``sampling_params``, ``context``, ``distributed``, ``comm``),
``backends``, ``model`` (with ``model/quant``), ``engine``; ``protocol`` beside them (it knows
nothing of the engine); ``frontend`` and ``server`` over the engine; ``entrypoints`` (and the
``python -m tpengine.run`` / ``tpengine.serve`` shims) on top. ``tpengine/__init__.py`` is the
public facade (``LLM``, ``SamplingParams``, lazily) and belongs to no layer.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tpengine"

#: package -> the packages it may import (besides itself)
MAY_IMPORT: dict[str, frozenset[str]] = {
    "structured": frozenset(),  # structured outputs: below core (SamplingParams holds a StructuredOutputsParams)
    "core": frozenset({"structured"}),
    "backends": frozenset({"core", "structured"}),
    "model": frozenset({"core", "backends", "structured"}),
    "engine": frozenset({"core", "backends", "model", "structured"}),
    "protocol": frozenset({"core", "structured"}),
    "frontend": frozenset({"core", "engine", "protocol", "structured"}),
    "server": frozenset({"core", "engine", "protocol", "frontend", "structured"}),
    "entrypoints": frozenset({"core", "backends", "model", "engine", "protocol", "frontend", "server", "structured"}),
}
#: root modules that are launch shims of the entry points (``python -m tpengine.run``)
ENTRY_SHIMS = ("run", "serve")


def package_of(module: str) -> str | None:
    """The layer of the dotted ``module`` (``tpengine.model.loader`` -> ``model``); None for the
    facade ``tpengine`` itself.

    Raises:
        ValueError: ``module`` is not a tpengine module or names a package :data:`MAY_IMPORT` lacks.
    """
    parts = module.split(".")
    if parts[0] != "tpengine":
        raise ValueError(f"not a tpengine module: {module!r}")
    if len(parts) == 1:
        return None
    name = parts[1]
    if (ROOT / name).is_dir():
        if name not in MAY_IMPORT:
            raise ValueError(f"package tpengine.{name} has no layer; add it to MAY_IMPORT in {__file__}")
        return name
    return "entrypoints" if name in ENTRY_SHIMS else "core"


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def module_imports(path: Path) -> list[str]:
    """The ``tpengine`` modules the file ``path`` imports when it runs (``from tpengine.x import y``
    counts as ``tpengine.x.y`` when ``y`` is a module of the package, else ``tpengine.x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "tpengine"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "tpengine":
            base = node.module
            for a in node.names:
                sub = ROOT.parent.joinpath(*base.split("."), a.name)
                found.append(f"{base}.{a.name}" if sub.is_dir() or sub.with_suffix(".py").is_file() else base)
    return found


def import_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """``(from package, to package)`` -> the modules that make that arrow, for every arrow between
    two different packages of the source tree ``root``."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src = package_of(module)
        if src is None:
            continue
        for target in module_imports(path):
            dst = package_of(target)
            if dst is not None and dst != src:
                edges[(src, dst)].append(f"{module} -> {target}")
    return dict(edges)


def violations(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """One line per import :data:`MAY_IMPORT` forbids in ``edges``
    (``"model -> engine: tpengine.model.x -> tpengine.engine.y"``)."""
    return [f"{src} -> {dst}: {how}" for (src, dst), hows in sorted(edges.items())
            if dst not in MAY_IMPORT[src] for how in hows]


def main() -> int:
    edges = import_edges()
    for (src, dst), hows in sorted(edges.items()):
        print(f"{src:12s} -> {dst:12s} {len(hows):3d} import(s)")
    bad = violations(edges)
    for line in bad:
        print(f"forbidden: {line}")
    print(f"{len(bad)} forbidden import(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
