"""``python -m tpengine.serve``, the form ``torchrun`` launches: the OpenAI server of
:mod:`tpengine.entrypoints.serve` (the same command as ``tpengine serve``)."""

from tpengine.startup import collector_paused

with collector_paused():  # the start's imports (tpengine/startup.py)
    from tpengine.entrypoints.serve import app

if __name__ == "__main__":
    app()
