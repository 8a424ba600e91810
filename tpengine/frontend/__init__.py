"""User-facing side of the batch job (and the server's request parsing): request files, output
records, the output file, progress.

Modules: ``requests`` (lines -> ParsedRequests through :mod:`tpengine.protocol`, tokenizing and the
chat template), ``request_file`` (a request file validated in one streaming pass, read again
lazily), ``job`` (rank 0's side of the job: feed the engine, one record per request), ``output``
(output records), ``writer`` (the locked append-and-flush ``--out``, ``--resume``), ``progress``
(rank-0 progress bar and summary). The engine never imports this package (the detokenizer lives
beside it, in ``tpengine.engine``).
"""
