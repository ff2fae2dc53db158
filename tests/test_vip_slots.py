"""Address slots of multi-node jobs (coordinator/ranks.py free_slot): each
coordinator looks for a free slot from a place its home picks, so two
coordinators on one machine (two users, the suite's parallel workers) do
not both hand out 10.213.1.x, whose routes on the shared host would carry
one job's packets to the other job's ranks."""

from __future__ import annotations

import pytest
from ckptd.coordinator.ranks import MAX_SLOTS, free_slot


def test_two_homes_start_apart_and_each_skips_its_own_slots() -> None:
    homes = [f"/home/user{k}/.ckptd" for k in range(40)]
    firsts = [free_slot(set(), h) for h in homes]
    assert all(1 <= s <= MAX_SLOTS for s in firsts)
    assert len(set(firsts)) > 30  # spread, not all on slot 1
    assert free_slot(set(), homes[0]) == firsts[0]  # the same home, the same place
    used = {firsts[0]}
    second = free_slot(used, homes[0])
    assert second not in used and second == firsts[0] % MAX_SLOTS + 1


def test_every_slot_taken_says_what_to_do() -> None:
    from ckptd.errors import CkptdError

    with pytest.raises(CkptdError, match="remove finished jobs"):
        free_slot(set(range(1, MAX_SLOTS + 1)), "/h")
