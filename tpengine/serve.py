"""``python -m tpengine.serve``, the form ``torchrun`` launches: the OpenAI server of
:mod:`tpengine.entrypoints.serve` (the same command as ``tpengine serve``)."""

from tpengine.entrypoints.serve import app

if __name__ == "__main__":
    app()
