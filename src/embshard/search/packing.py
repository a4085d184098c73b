"""Memory packing for a greedy that places pieces one at a time: keep the pieces still to
be placed packable (a proof by first-fit decreasing, updated in O(1) where it stays valid)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


class LookAhead:
    """Keeps the pieces still to be placed packable while a greedy places them in order.

    It carries a proof: an assignment of every pending piece to a device that fits in the
    devices' free memory (found by first-fit decreasing, like `MemoryLedger`'s look-ahead).
    Placing a piece on a device whose slack under that assignment has room keeps the proof
    valid in O(1); otherwise the pending pieces are repacked by first-fit decreasing for the
    most preferred device, then tried on the others in order (as `MemoryLedger.place`
    does). When nothing packs, the most preferred device with room is taken.

    Args:
        free: free bytes per device before the first placement.
        needs: bytes of every piece, in placement order.
    """

    def __init__(self, free: np.ndarray, needs: Sequence[int]):
        self.needs = np.asarray(needs, dtype=np.int64)
        self._needs_list = [int(x) for x in needs]
        self._desc = np.argsort(-self.needs, kind="stable")
        self.assign = np.full(len(self.needs), -1, dtype=np.int64)
        self.slack = np.asarray(free, dtype=np.int64).copy()
        self.valid = self._repack(np.asarray(free, dtype=np.int64), 0)
        self.repacks = 0

    def _repack(self, free: np.ndarray, start: int) -> bool:
        """First-fit decreasing of pieces start.. into `free`; adopt it when it fits."""
        assign = self.assign.copy()
        todo = self._desc[self._desc >= start].tolist()
        if len(free) <= 32:  # a plain scan beats numpy on a few devices
            fl = [int(x) for x in free]
            needs = self._needs_list
            for k in todo:
                need = needs[k]
                for j, room in enumerate(fl):
                    if room >= need:
                        fl[j] = room - need
                        assign[k] = j
                        break
                else:
                    return False
            self.assign, self.slack = assign, np.array(fl, dtype=np.int64)
            return True
        f = free.copy()
        for k in todo:
            need = self.needs[k]
            j = int(np.argmax(f >= need))
            if f[j] < need:
                return False
            f[j] -= need
            assign[k] = j
        self.assign, self.slack = assign, f
        return True

    def choose(self, i: int, free: np.ndarray, preference: Sequence[int]) -> int:
        """The device for piece `i` (first of `preference` with room that keeps the rest
        packable); updates the proof. The caller then takes the memory."""
        need = int(self.needs[i])
        room = [d for d in preference if free[d] >= need]
        if not room:
            raise ValueError("choose() needs a preferred device with room")
        if self.valid:
            self.slack[self.assign[i]] += need  # piece i is no longer pending
            first = room[0]
            if self.slack[first] >= need:
                self.slack[first] -= need
                return first
            self.repacks += 1
            if self._repack_after(free, first, need, i):
                return first
            for d in room[1:]:
                if self.slack[d] >= need:
                    self.slack[d] -= need
                    return d
            rest = room[1:]
        else:
            rest = room
        for d in rest:
            self.repacks += 1
            if self._repack_after(free, d, need, i):
                self.valid = True
                return d
        self.valid = False
        return room[0]

    def _repack_after(self, free: np.ndarray, device: int, need: int, i: int) -> bool:
        f = free.copy()
        f[device] -= need
        return self._repack(f, i + 1)
