"""The package layering (docs/design.md, "The house"; issue 34): no package imports one above it,
so there is no cycle between packages, and importing the model pulls in no engine, server or
batch front end."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.imports import MAY_IMPORT, import_edges, package_of, violations


def test_no_package_imports_one_above_it():
    edges = import_edges()
    assert violations(edges) == []
    assert ("model", "backends") in edges and ("engine", "model") in edges  # the scan does see imports


def test_the_layers_have_no_cycle():
    seen: dict[str, int] = {}

    def depth(pkg: str, path: tuple[str, ...] = ()) -> int:
        assert pkg not in path, f"cycle: {' -> '.join(path + (pkg,))}"
        if pkg not in seen:
            seen[pkg] = 1 + max((depth(d, path + (pkg,)) for d in MAY_IMPORT[pkg]), default=0)
        return seen[pkg]

    # the longest chain: structured, core, backends, model, engine, frontend, server, entrypoints
    assert {p: depth(p) for p in MAY_IMPORT}["entrypoints"] == 8


def test_a_forbidden_arrow_is_reported():
    edges = {("model", "engine"): ["tpengine.model.loader -> tpengine.engine.step"],
             ("engine", "model"): ["tpengine.engine.model_runner -> tpengine.model.loader"]}
    assert violations(edges) == ["model -> engine: tpengine.model.loader -> tpengine.engine.step"]
    assert package_of("tpengine.run") == "entrypoints" and package_of("tpengine.config") == "core"
    assert package_of("tpengine.model.quant.weights") == "model" and package_of("tpengine") is None


def _loaded_after(statement: str) -> list[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return [m for m in json.loads(out) if m.startswith("tpengine")]


def test_importing_the_model_loads_no_engine_server_or_frontend():
    loaded = _loaded_after("import tpengine.model.loader, tpengine.model.surgery")
    assert "tpengine.model.loader" in loaded
    above = [m for m in loaded if package_of(m) in ("engine", "server", "frontend", "entrypoints", "protocol")]
    assert above == []


def test_the_protocol_knows_nothing_of_the_engine():
    loaded = _loaded_after("import tpengine.protocol.fields, tpengine.protocol.requests, tpengine.protocol.stream")
    assert [m for m in loaded if package_of(m) not in ("protocol", "core", "structured", None)] == []
