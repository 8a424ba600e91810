"""tpengine.startup: the collector is off inside collector_paused() and as it was after it."""

import gc

import pytest

from tpengine.startup import collector_paused


@pytest.mark.parametrize("on_before", [True, False])
def test_collector_is_off_inside_and_as_it_was_after_also_on_an_error(on_before):
    (gc.enable if on_before else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():  # nested: the inner block leaves it off for the outer one
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled() is on_before
        with pytest.raises(ValueError, match="boom"), collector_paused():
            raise ValueError("boom")
        assert gc.isenabled() is on_before
    finally:
        gc.enable()


def test_importing_the_facade_leaves_the_collector_on():
    """``from tpengine import LLM`` imports the engine with the collector off and turns it back on."""
    import tpengine

    gc.enable()
    tpengine.__getattr__("SamplingParams")
    assert gc.isenabled()


def test_run_main_exits_with_the_code_after_atexit_and_flushing():
    """run_main leaves through os._exit with main's exit code (None: 0, a message: printed, 1), after the
    atexit functions ran and the buffered streams were flushed, without the interpreter's teardown (a
    global's __del__ never runs); under a profiler it is the usual exit, teardown included."""
    import subprocess
    import sys

    prog = ("import atexit, sys\nfrom tpengine.startup import run_main\n"
            "atexit.register(lambda: print('atexit ran', end=''))\nsys.stdout.write('buffered ')\n"
            "class TornDown:\n    def __del__(self, write=__import__('os').write):\n        write(2, b'torn down')\n"
            "kept = TornDown()\n"
            "def main():\n    raise SystemExit({code})\nrun_main(main)\nprint('not reached')\n")
    for code, rc, out, err in ((3, 3, "buffered atexit ran", ""), (None, 0, "buffered atexit ran", ""),
                               ("'bad'", 1, "buffered atexit ran", "bad\n")):
        got = subprocess.run([sys.executable, "-c", prog.format(code=code)], capture_output=True, text=True)
        assert (got.returncode, got.stdout, got.stderr) == (rc, out, err)
    profiled = subprocess.run([sys.executable, "-c", "import sys; sys.setprofile(lambda *a: None)\n"
                               + prog.format(code=0)], capture_output=True, text=True)
    assert (profiled.returncode, profiled.stdout, profiled.stderr) == (0, "buffered atexit ran", "torn down")
