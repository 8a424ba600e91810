"""User-facing entry points in Python: the offline :class:`tpengine.entrypoints.llm.LLM` API."""
