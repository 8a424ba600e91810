"""Rank 0's side of the main job: skip finished ids, tokenize, run the engine, write one record per request."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from tpengine.engine.outputs import RequestOutput
from tpengine.frontend.output import error_record, make_record, openai_error_record
from tpengine.frontend.progress import ProgressReporter
from tpengine.frontend.requests import ParsedRequest, RequestError, RequestValidationError, to_token_ids
from tpengine.frontend.writer import OutputWriter
from tpengine.memory import gather_peak_rss


def error_records(errors: list[RequestError], taken: Iterable[str] = ()) -> list[tuple[int, dict]]:
    """One (line, record) per invalid line; several problems on a line are joined.

    ``taken``: the ids of the valid requests. An error record never shares its id with another
    record: when the line's id is taken (a duplicate id, or the default line-number id of an
    unparseable line that a valid request uses explicitly) or already used by an earlier error
    record, the record's id (``custom_id`` for OpenAI Batch lines) is ``"<id>#line<N>"`` (or
    ``"<id>#line<N>#2"``, ``#3``, ... if a request uses that id too).
    """
    by_line: dict[int, list[RequestError]] = defaultdict(list)
    for e in errors:
        by_line[e.line].append(e)
    out = []
    used = set(taken)
    for line, errs in sorted(by_line.items()):
        first = errs[0]
        rid = first.id if first.id is not None else str(line - 1)
        if rid in used:
            base = rid = f"{rid}#line{line}"
            k = 1
            while rid in used:  # a request may carry that very id: "<id>#line<N>#2", ...
                k += 1
                rid = f"{base}#{k}"
        used.add(rid)
        msg = "; ".join((f"{e.field}: " if e.field else "") + e.message for e in errs)
        rec = (error_record(rid, msg, first.field, line) if first.format == "simple"
               else openai_error_record(rid, line, msg, first.field))
        out.append((line, rec))
    return out


def drive(engine, requests: list[ParsedRequest], errors: list[RequestError], writer: OutputWriter,
          done: tuple[set[str], set[int]], model_name: str) -> dict[str, Any]:
    """Rank 0: skip ``done`` (ids, invalid-line numbers: ``read_done`` of ``--out`` with ``--resume``),
    tokenize, run, write each record through ``writer`` as it finishes (closing it); return the summary.
    ``engine`` is None when there is no valid request: only the error records are written."""
    done, done_lines = done
    todo = [r for r in requests if r.id not in done]
    bad = [(n, rec) for n, rec in error_records(errors, {r.id for r in requests}) if n not in done_lines]
    progress = ProgressReporter(total=len(todo) + len(bad))
    by_id = {r.id: r for r in todo}
    written: set[str] = set()
    with writer:
        for _, rec in bad:
            writer.write(rec)
            progress.add_errors()

        def on_output(o: RequestOutput) -> None:
            if o.request_id in written:
                return
            written.add(o.request_id)
            writer.write(make_record(by_id.get(o.request_id), o, model_name))
            progress.on_output(o)

        try:
            if engine is not None:
                tok = engine.tokenizer
                vocab = engine.vocab_size  # the model's (maybe > len(tokenizer))
                batch = []
                for r in todo:
                    try:
                        batch.append((r.id, to_token_ids(r, tok, vocab), r.params))
                    except RequestValidationError as e:
                        on_output(RequestOutput(r.id, [], error=str(e), error_field=e.field))
                results = engine.generate(batch, on_output=on_output, on_step=progress.on_step)
                for o in results or []:  # in case an output was not reported through on_output
                    on_output(o)
                progress.peak_rss = gather_peak_rss()  # every rank calls it after generate
        finally:
            progress.close()
    return progress.print_summary()
