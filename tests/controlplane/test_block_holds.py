"""block_holds.Overlaps: the bitmap says a block is taken while any holder holds it,
and the free counts it returns keep an engine's free count equal to its clear bits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, strategies as st

from kvpush.controlplane.block_holds import Overlaps

BLOCKS = 12


def test_a_block_held_twice_stays_taken_until_both_let_go():
    bitmap, holds = np.zeros(BLOCKS, dtype=bool), Overlaps()
    assert holds.take("e", bitmap, 0, 4) == 4      # a quarantine
    assert holds.take("e", bitmap, 2, 4) == 2      # a grant over half of it (another replica's)
    assert holds.give("e", bitmap, 0, 4) == 2      # the quarantine ends: 0 and 1 only are free
    assert bitmap.tolist()[:6] == [False, False, True, True, True, True] and len(holds) == 0
    assert holds.give("e", bitmap, 2, 4) == 4
    assert not bitmap.any()


@given(st.lists(st.tuples(st.integers(0, BLOCKS - 1), st.integers(1, 4)), min_size=1, max_size=8),
       st.randoms(use_true_random=False))
def test_any_order_of_ends_leaves_exactly_the_blocks_still_held(extents, rnd):
    extents = [(s, min(c, BLOCKS - s)) for s, c in extents]
    bitmap, holds, free = np.zeros(BLOCKS, dtype=bool), Overlaps(), BLOCKS
    for s, c in extents:
        free -= holds.take("e", bitmap, s, c)
    held = list(extents)
    rnd.shuffle(held)
    while held:
        s, c = held.pop()
        free += holds.give("e", bitmap, s, c)
        want = np.zeros(BLOCKS, dtype=bool)
        for s2, c2 in held:
            want[s2:s2 + c2] = True
        assert bitmap.tolist() == want.tolist()
        assert free == BLOCKS - int(bitmap.sum())
    assert len(holds) == 0
