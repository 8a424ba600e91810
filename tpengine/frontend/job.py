"""Rank 0's side of the main job: skip finished ids, tokenize, run the engine, write one record per request."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from tpengine.engine.memory import gather_peak_rss
from tpengine.engine.output_processor import failed_output, failed_request
from tpengine.engine.outputs import EngineOutput
from tpengine.frontend.output import error_record, make_record, openai_error_record
from tpengine.frontend.progress import ProgressReporter
from tpengine.frontend.reasoning import REASONING_PARSERS, ReasoningParser, thought_tags
from tpengine.frontend.requests import (
    EchoPrompt,
    ParsedRequest,
    RequestError,
    RequestValidationError,
    echo_prompt,
    failure_message,
    to_token_ids,
)
from tpengine.frontend.writer import OutputWriter


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


def _record_resources(engine, progress: ProgressReporter) -> None:
    """After ``generate``, for the run summary: the ranks' peak RSS (``gather_peak_rss``: every rank calls it)
    and rank 0's KV cache (its kind, blocks and bytes per token)."""
    progress.peak_rss = gather_peak_rss()
    runner = engine.runner
    progress.kv_cache = {"dtype": engine.config.kv_cache_dtype, "blocks": runner.num_blocks,
                         "bytes_per_token": runner.kv_bytes_per_token}


def drive(engine, requests: Iterable[ParsedRequest], errors: list[RequestError], writer: OutputWriter,
          done: tuple[set[str], set[int]], model_name: str) -> dict[str, Any]:
    """Rank 0: run every valid request not in ``done`` and write one record per request through
    ``writer`` as it finishes (closing it at the end); return the run summary.

    ``requests``: a list, or a :class:`tpengine.frontend.request_file.RequestFile` (read lazily, with
    the ids of its valid requests in ``.ids``); ``done``: (ids, invalid-line numbers) that ``--out``
    already holds (``read_done`` with ``--resume``). ``engine`` is None when there is no valid
    request: only the error records are written.

    With the engine's ``reasoning_parser``, an OpenAI chat line's record splits the thought off into
    ``reasoning_content`` and its output constraint starts after it, as the server's
    (:mod:`tpengine.frontend.reasoning`); simple lines get the text as generated, constrained from
    its first token.

    No request ends the job: whatever one request's content raises while it is templated,
    tokenized, scheduled, sampled, detokenized or written becomes that request's error record
    (``"<stage> failed: <exception>"``), and the other requests go on. Requests are tokenized only
    as the engine takes them, so a file of any length is never held tokenized at once.
    """
    done, done_lines = done
    ids = getattr(requests, "ids", None)
    if ids is None:
        requests = list(requests)
        ids = {r.id for r in requests}
    bad = [(n, rec) for n, rec in error_records(errors, ids) if n not in done_lines]
    progress = ProgressReporter(total=sum(rid not in done for rid in ids) + len(bad))
    running: dict[str, ParsedRequest] = {}  # taken by the engine, record not yet written
    echoes: dict[str, EchoPrompt] = {}  # of the running requests that asked for echo
    thoughts: dict[str, ReasoningParser] = {}  # of the running OpenAI chat lines, with --reasoning-parser
    parser = None if engine is None else engine.config.reasoning_parser

    def on_output(o: EngineOutput) -> None:
        req = running.pop(o.request_id, None)
        echo = echoes.pop(o.request_id, None)
        thought = thoughts.pop(o.request_id, None)
        try:
            rec = make_record(req, o, model_name, echo, thought)
        except Exception as e:  # noqa: BLE001 -- this request's record cannot be built: its error record
            o = failed_output(o.request_id, o.prompt_token_ids, "writing its record", e)
            rec = make_record(req, o, model_name)
        writer.write(rec)
        progress.on_output(o)

    def feed(tok, vocab: int) -> Iterator[tuple[str, list[int], Any]]:
        for r in requests:
            if r.id in done:
                continue
            try:
                prompt = to_token_ids(r, tok, vocab)
                if r.echo:
                    echoes[r.id] = echo_prompt(r.kind, r.payload, prompt, r.params, tok)
            except RequestValidationError as e:
                on_output(EngineOutput(r.id, [], error=str(e), error_field=e.field))
                continue
            except Exception as e:  # noqa: BLE001 -- e.g. the chat template's raise_exception, a lone surrogate
                on_output(failed_request(r.id, failure_message(r, e)))
                continue
            params = r.params
            if parser is not None and r.format == "openai_chat":  # the server's split, the same decision
                kwargs = (r.template_options or {}).get("chat_template_kwargs")
                thoughts[r.id] = REASONING_PARSERS[parser].for_request(
                    thought_tags(parser, tok), tok, prompt, kwargs, params.skip_special_tokens)
                params = replace(params, thinking=thoughts[r.id].thinking)
            running[r.id] = r
            yield r.id, prompt, params

    with writer:
        for _, rec in bad:
            writer.write(rec)
            progress.add_errors()
        try:
            if engine is not None:
                # the model's vocabulary size (maybe > len(tokenizer)) bounds prompt token ids
                engine.generate(feed(engine.tokenizer, engine.vocab_size), on_output=on_output,
                                on_step=progress.on_step)
                _record_resources(engine, progress)
        finally:
            progress.close()
    return progress.print_summary()
