"""User-facing side of the main job: request files, detokenization, output records, progress.

Modules: ``requests`` (parse + validate JSONL, tokenize), ``detokenizer`` (incremental text with
stop strings), ``output`` (output records, append-only writer, ``--resume``), ``progress``
(rank-0 progress bar and summary).
"""
