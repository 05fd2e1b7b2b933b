"""Engine.freeze_gc: the heap alive at start-up leaves the cyclic GC's reach (no full-heap
pauses while serving), the engine serves as before, and close() gives the heap back so a closed
engine's reference cycles are collected."""
import gc
import weakref

from engine_fakes import assert_clean, make_engine, reference_greedy, run_all
from services.protocol.sampling import SamplingParams


def test_freeze_then_close_releases_the_engine():
    engine = make_engine(max_len=64, block_size=4)
    engine.freeze_gc()
    try:
        assert gc.get_freeze_count() > 1000          # the imported libraries, not only the engine
        engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        out = run_all(engine)
        assert out[("a", 0)]["tokens"] == reference_greedy([5, 6, 7], 5)
        assert_clean(engine)
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0                # gc.unfreeze: the whole permanent generation
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None, "a closed engine must be collectable"


def test_close_without_freeze_leaves_others_frozen_heap_alone(monkeypatch):
    # The exact freeze count is not stable (a frozen object another module drops, e.g. a
    # compiler's lazily replaced cache, leaves the permanent generation), so the check is that
    # close() never unfreezes a heap it did not freeze, and that heap stays frozen.
    unfreezes = []
    real_unfreeze = gc.unfreeze
    monkeypatch.setattr(gc, "unfreeze", lambda: unfreezes.append(1) or real_unfreeze())
    gc.freeze()                                      # someone else's freeze (e.g. the host app)
    try:
        frozen = gc.get_freeze_count()
        engine = make_engine(max_len=64, block_size=4)
        engine.close()
        assert unfreezes == []
        assert gc.get_freeze_count() > frozen // 2   # an unfreeze would leave 0
    finally:
        real_unfreeze()
