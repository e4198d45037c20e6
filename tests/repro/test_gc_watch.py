"""rlk_repro.jitwatch's GC record: Python's collections made inside a phase are counted there, by generation, with
their pauses; nothing outside a watch's life is; closing it removes its callback."""

from __future__ import annotations

import gc

from rlk_repro.jitwatch import JitWatch


def test_collections_are_counted_in_the_phase_they_ran_in():
    watch = JitWatch()
    try:
        watch.take_gc()  # whatever ran before
        with watch.phase("rollout"):
            gc.collect(0)
            gc.collect(2)
        with watch.phase("train"):
            gc.collect(1)
        got = watch.take_gc()
    finally:
        watch.close()
    # (a collection the interpreter starts on its own may add to a phase; those made here are all there)
    assert got["rollout"]["by_generation"].get("0", 0) >= 1 and got["rollout"]["by_generation"].get("2", 0) >= 1
    assert got["train"]["by_generation"].get("1", 0) >= 1 and got["rollout"]["collections"] >= 2
    assert 0 < got["rollout"]["max_s"] <= got["rollout"]["seconds"]
    assert watch._gc_event not in gc.callbacks
    gc.collect()
    assert watch.take_gc() == {}  # closed: nothing recorded
