"""return_freed_memory (hacpo_megatron/environment.py): cycles made after its first call are still collected, and
the objects alive at that call are frozen out of later collections (what made a call cost ~0.2 s a step)."""
import subprocess
import sys
import textwrap

from tests.models.torchrun import REPO

PROBE = textwrap.dedent("""
    import gc, json, weakref
    from hacpo_megatron.environment import return_freed_memory

    class Node:
        pass

    def cycle():  # an object only a reference cycle keeps alive: reference counting never frees it
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    gc.disable()  # no automatic collection: only return_freed_memory's
    long_lived = [Node() for _ in range(20000)]
    plain = cycle()
    return_freed_memory()  # without freeze: a collection, nothing frozen
    frozen_without = gc.get_freeze_count()
    before = cycle()
    return_freed_memory(freeze=True)
    frozen_first = gc.get_freeze_count()
    after = cycle()
    return_freed_memory(freeze=True)
    print(json.dumps({"plain_collected": plain() is None, "frozen_without": frozen_without,
                      "before_collected": before() is None, "after_collected": after() is None,
                      "frozen_first": frozen_first, "frozen_second": gc.get_freeze_count(),
                      "tracked_after": len(gc.get_objects())}))
""")


def test_freed_memory_collects_new_cycles_and_freezes_the_long_lived_objects_once_when_asked():
    import json

    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["plain_collected"] and report["frozen_without"] == 0  # without freeze=True: today's collection
    assert report["before_collected"] and report["after_collected"]  # a cycle made after the freeze still goes
    assert report["frozen_first"] >= 20000  # the long-lived objects, frozen at the first call ...
    assert report["frozen_second"] == report["frozen_first"]  # ... and only then
    assert report["tracked_after"] < 1000  # what later collections traverse: the rest
