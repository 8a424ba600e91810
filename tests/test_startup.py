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
