"""Every schema of :mod:`benchmarks.structured_schemas` through ``LLM`` at this launch's tp, greedy
and seeded: how many outputs validate (``jsonschema``, formats checked), and the invalid ones.

    python -m benchmarks.structured_validity                                   (tp=1)
    torchrun --nproc_per_node=2 -m benchmarks.structured_validity --out v2.json

Seeded requests sample at ``--temperature`` with seed ``--seed + i``; ``--disable-any-whitespace``
asks for JSON without free whitespace (vLLM's option; the default lets the model put whitespace where
JSON allows it, which a small model sampling hot can spend its ``--max-tokens`` on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.structured_schemas import SCHEMAS
from tpengine.config import DEFAULT_MODEL_DIR

app = typer.Typer(add_completion=False)


@app.command()
def main(
    model: Annotated[str, typer.Option(help="model folder")] = DEFAULT_MODEL_DIR,
    max_tokens: Annotated[int, typer.Option(help="most tokens per output")] = 512,
    temperature: Annotated[float, typer.Option(help="the seeded run's temperature")] = 0.8,
    seed: Annotated[int, typer.Option(help="the seeded run's first seed")] = 7,
    disable_any_whitespace: Annotated[bool, typer.Option(help="JSON without free whitespace")] = False,
    dtype: Annotated[str, typer.Option(help="engine dtype")] = "float32",
    out: Annotated[Path | None, typer.Option(help="write the results here as JSON (rank 0)")] = None,
) -> None:
    import jsonschema

    from tpengine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model, dtype=dtype, max_model_len=1024)
    chats = [[{"role": "user", "content": q}] for q, _ in SCHEMAS]
    result = {}
    for name, temp in (("greedy", 0.0), ("seeded", temperature)):
        params = [SamplingParams(temperature=temp, seed=None if temp == 0 else seed + i, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(
                                     json=s, disable_any_whitespace=disable_any_whitespace))
                  for i, (_, s) in enumerate(SCHEMAS)]
        outs = llm.chat(chats, params)
        bad = []
        for i, (o, (_, schema)) in enumerate(zip(outs, SCHEMAS)):
            c = o.outputs[0]
            try:
                jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(
                    json.loads(c.text))
            except (ValueError, jsonschema.ValidationError) as e:
                bad.append({"schema": i, "finish_reason": c.finish_reason, "error": str(e).splitlines()[0][:200]})
        result[name] = {"valid": len(SCHEMAS) - len(bad), "of": len(SCHEMAS), "invalid": bad,
                        "token_ids": [o.outputs[0].token_ids for o in outs]}
    from tpengine.distributed import get_tp

    if get_tp().is_driver:
        for name, r in result.items():
            print(f"{name}: {r['valid']}/{r['of']} valid at tp={get_tp().size}" +
                  "".join(f"\n  schema {b['schema']} ({b['finish_reason']}): {b['error']}" for b in r["invalid"]))
        if out is not None:
            out.write_text(json.dumps(result) + "\n")
    llm.shutdown()


if __name__ == "__main__":
    app()
