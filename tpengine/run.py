"""``python -m tpengine.run``, the form ``torchrun`` launches: the batch job of
:mod:`tpengine.entrypoints.run` (the same command as ``tpengine run``)."""

from tpengine.startup import collector_paused, run_main

with collector_paused():  # the start's imports (tpengine/startup.py)
    from tpengine.entrypoints.run import app

if __name__ == "__main__":
    run_main(app)  # leaves without the interpreter's teardown (tpengine/startup.py)
