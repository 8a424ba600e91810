"""tpengine: a small tensor-parallel inference engine for Hugging Face decoder LLMs."""

__version__ = "0.1.0"
