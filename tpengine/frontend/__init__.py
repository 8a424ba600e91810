"""User-facing side of the main job: request files, output records, progress.

Modules: ``requests`` (parse + validate JSONL, tokenize), ``output`` (output records,
append-only writer, ``--resume``), ``progress`` (rank-0 progress bar and summary). The engine
never imports this package (the detokenizer lives beside it, in ``tpengine.engine``).
"""
