"""Memory packing for planners that place pieces one at a time: keep the pieces still to be
placed packable, in O(1) per placement while a carried proof stays valid.

`LookAhead` carries a proof: an assignment of every pending piece to a device that fits in
the devices' free memory (first-fit decreasing, or worst-fit decreasing: each piece on the
device with the most room left, which spreads the pending pieces and leaves slack on every
device; where worst fit finds no packing, first fit is tried, as it can find one worst fit
misses). Placing a piece on a device whose slack under that assignment has room keeps the
proof valid in O(1); otherwise the pending pieces are repacked from scratch (under the ledger's
rule the proof is first mended: the pieces it holds on that device moved to others).

Two callers, two rules:
* the greedy partitioner (`choose`): the first preferred device that keeps the rest packable;
  the proof is repacked for the most preferred device, then the others are tried by slack,
  then by repacking (`embshard.search.greedy`). It does not mend: a mend there changed
  NeuroShard's plans on tight tasks (which device the later steps try depends on the proof);
* `embshard.plan.MemoryLedger` (`forget`, `packs_after`, `took`): every heuristic's and RL
  policy's placements; a device is accepted when the proof's slack has room, when the proof
  mended holds it (`_repair`), or when first-fit decreasing from scratch packs the rest, and
  turned down at once where the largest pending pieces fit by no packing (`unpackable`).

Either way a repack that fails within its 16 largest pieces, as most do under tight memory, is
told from those pieces and the rooms they can reach (`_fails_early`) before it is set up.
"""

from __future__ import annotations

import copy
import heapq
from typing import Callable, Sequence

import numpy as np

FITS = ("first", "worst")


class LookAhead:
    """A proof that the pending pieces pack (module docstring).

    Args:
        free: free bytes per device before the first placement.
        needs: bytes of every piece (pieces are named by their index here).
        fit: how the proof packs: "first" (first-fit decreasing) or "worst" (worst-fit
            decreasing).
    """

    def __init__(self, free: np.ndarray, needs: Sequence[int], fit: str = "first"):
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
        self.fit = fit
        self.needs = np.asarray(needs, dtype=np.int64)
        self._needs_list = [int(x) for x in needs]
        self._desc = np.argsort(-self.needs, kind="stable")
        self.pending = np.ones(len(self.needs), dtype=bool)
        self.num_pending = len(self.needs)
        self._head = 0  # every piece of _desc before it is placed (pieces are only ever placed)
        self._largest: tuple[int, list[int], set[int]] | None = None  # _largest_pending's (r, needs, pieces)
        self.assign = np.full(len(self.needs), -1, dtype=np.int64)
        self.slack = np.asarray(free, dtype=np.int64).copy()
        self.valid = self._repack(np.asarray(free, dtype=np.int64))
        self.repacks = 0
        self.mends = 0  # proofs mended instead of repacked (`_repair`)
        # mends of the proof as it is now, by (device, need), for `took` to adopt; cleared when it changes
        self._mends: dict[tuple[int, int], tuple[np.ndarray, np.ndarray] | None] = {}

    # ------------------------------------------------------------------ packing
    def _largest_pending(self, r: int) -> list[int]:
        """The needs of the (at most) `r` largest pending pieces, largest first, in the order
        `_pack` places them; O(r) amortised, not O(pieces), and kept until one of them is placed."""
        if self._largest is not None and self._largest[0] == r:
            return self._largest[1]
        desc, pending = self._desc, self.pending
        h, n = self._head, len(desc)
        while h < n and not pending[desc[h]]:
            h += 1
        self._head = h
        window = desc[h:h + 4 * r]
        got = window[pending[window]]
        if len(got) < r and h + 4 * r < n:
            rest = desc[h:]
            got = rest[pending[rest]]
        got = got[:r]
        self._largest = (r, self.needs[got].tolist(), set(got.tolist()))
        return self._largest[1]

    @staticmethod
    def _roomiest(free: np.ndarray, k: int) -> list[int]:
        """The `k` largest rooms of `free`, most first."""
        m = len(free)
        return sorted(np.partition(free, m - k)[m - k:].tolist(), reverse=True)

    def _fails_early(self, free: np.ndarray, fit: str, r: int = 16) -> bool:
        """Whether packing by `fit` into `free` (more than 32 devices) fails within its first
        `r` pieces, told from the rooms those pieces can reach without the O(pieces) set-up of
        a repack (under tight memory most repacks fail there). Exact: True only where `_pack`
        returns None."""
        needs = self._largest_pending(r)
        if not needs:
            return False
        if fit == "worst":
            # the first r pieces only reach the r roomiest devices (each step takes the roomiest:
            # a device lowered before, or the next untouched one), and whether one of them does
            # not fit depends on the rooms alone, not on which of equally roomy devices it takes
            k = min(len(needs), len(free))
            top = [-x for x in self._roomiest(free, k)]  # a heap already: ascending
            for need in needs[:k]:
                if -top[0] < need:
                    return True
                heapq.heapreplace(top, top[0] + need)
            return False
        # first fit: a device with less room than the smallest of these pieces takes none of
        # them, so they go where they would among the devices that have it, in index order
        rooms = free[free >= needs[-1]].tolist()
        if len(rooms) > 64:
            return False  # many devices to scan: the repack itself is as quick
        for need in needs:
            for j, room in enumerate(rooms):
                if room >= need:
                    rooms[j] = room - need
                    break
            else:
                return True
        return False

    def unpackable(self, free: np.ndarray, r: int = 16) -> bool:
        """Whether the pending pieces fit into `free` by no packing at all, told from the `r`
        largest (True only where none exists; False says nothing): if piece j and the one before
        it together need more than any device has, no two of the j + 1 largest share a device,
        so at least j + 1 devices need room for the j-th."""
        needs = self._largest_pending(r)
        if not needs:
            return False
        rooms = self._roomiest(np.asarray(free, dtype=np.int64), min(len(needs), len(free)))
        most = rooms[0]
        for j, need in enumerate(needs):
            if j and needs[j - 1] + need <= most:
                return False  # two of them can share a device from here on
            if j >= len(rooms) or rooms[j] < need:
                return True
        return False

    def _pack(self, free: np.ndarray, fit: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(assignment, slack) of the pending pieces in decreasing size into `free`; None when
        one does not fit."""
        worst = fit == "worst"
        if len(free) > 32 and self._fails_early(np.asarray(free, dtype=np.int64), fit):
            return None
        assign = self.assign.copy()
        todo = self._desc[self.pending[self._desc]]
        if len(free) <= 32:  # a plain scan beats numpy on a few devices
            fl = [int(x) for x in free]
            needs = self._needs_list
            for k in todo.tolist():
                need = needs[k]
                if worst:
                    j = max(range(len(fl)), key=fl.__getitem__)
                    if fl[j] < need:
                        return None
                    fl[j] -= need
                    assign[k] = j
                    continue
                for j, room in enumerate(fl):
                    if room >= need:
                        fl[j] = room - need
                        assign[k] = j
                        break
                else:
                    return None
            return assign, np.array(fl, dtype=np.int64)
        if worst:
            return self._worst_fit(free, todo, assign)
        return self._first_fit(free, todo, assign)

    def _worst_fit(self, free: np.ndarray, todo: np.ndarray, assign: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Worst-fit decreasing on many devices (each piece on the device with the most room,
        the lowest index among equals), by rounds in numpy, with a heap for what rounds do not
        place fast. Each device has one int key, room << shift | (mask - index): the highest key
        is the device the next piece takes. A round starts from the keys sorted, highest first,
        and places in one go either a run of pieces on the first device (while its room after
        each stays above the second's key: a cumulative sum) or one piece on each of the first
        devices in turn (while each device's key stays above every key already lowered this
        round: a running maximum). Either way each piece goes where one piece at a time would
        put it, so the assignment, slack and verdict are plain worst-fit decreasing's. Under
        tight memory a successful repack of thousands of pieces takes a dozen rounds; where
        rounds place few pieces each (devices leapfrogging), the rest goes through the heap."""
        m = len(free)
        shift = max(1, m - 1).bit_length()
        mask = (1 << shift) - 1
        free = np.asarray(free, dtype=np.int64)
        needs = self.needs[todo]  # decreasing
        n = len(todo)
        bound = 1 << (62 - shift)
        if n == 0 or int(np.max(free)) >= bound or int(needs.sum()) >= bound:  # keys would overflow int64
            return self._worst_fit_heap(free, todo, assign, shift)
        keys = (free << shift) | (mask - np.arange(m, dtype=np.int64))
        to = np.empty(n, dtype=np.int64)
        keys = -np.sort(-keys)  # highest first
        k = few = 0  # few: rounds in a row that placed fewer than 16 pieces
        window = 64
        while k < n:
            if few >= 8:  # rounds place few pieces here (devices trading the lead): the heap is faster
                rooms, low = keys >> shift, keys & mask
                heap = ((-rooms << shift) | (mask - low)).tolist()
                return self._worst_fit_heap(free, todo, assign, shift, heap=heap, start=k, to=to)
            top = int(keys[0])
            room = top >> shift
            if room < needs[k]:
                return None
            second = int(keys[1])  # _pack calls this with more than 32 devices
            end = min(n, k + window)
            total = np.cumsum(needs[k:end])
            lowered = ((room - total) << shift) | (top & mask)  # the first device's key after each piece
            run = 1 + int(np.searchsorted(-lowered[:-1], -second, side="left"))  # it stays the highest
            if run > 1:
                if (room - np.concatenate(([0], total[:run - 1])) < needs[k:k + run]).any():
                    return None  # a piece does not fit in the most room there is
                to[k:k + run] = mask - (top & mask)
                rest = keys[1:]
                keys = np.insert(rest, int(np.searchsorted(-rest, -int(lowered[run - 1]))), lowered[run - 1])
                window = min(4 * window, 4096) if run == end - k else 64
                k += run
                few = few + 1 if run < 16 else 0
                continue
            b = min(m, n - k)  # one piece on each of the first devices, in turn
            rooms = keys[:b] >> shift
            sizes = needs[k:k + b]
            after = ((rooms - sizes) << shift) | (keys[:b] & mask)
            ahead = keys[1:b] > np.maximum.accumulate(after)[:-1]
            stop = b if ahead.all() else int(np.argmin(ahead)) + 1
            if (rooms[:stop] < sizes[:stop]).any():
                return None
            to[k:k + stop] = mask - (keys[:stop] & mask)
            keys[:stop] = after[:stop]
            keys = -np.sort(-keys)
            k += stop
            few = few + 1 if stop < 16 else 0
        assign[todo] = to
        f = np.empty(m, dtype=np.int64)
        f[mask - (keys & mask)] = keys >> shift
        return assign, f

    def _worst_fit_heap(self, free: np.ndarray, todo: np.ndarray, assign: np.ndarray, shift: int,
                        heap: list[int] | None = None, start: int = 0,
                        to: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """Worst-fit decreasing through a heap of the devices by most room, lowest index among
        equals: one int per device, -room << shift | index (ints compare faster than tuples).
        `heap`, `start`, `to`: go on from `_worst_fit`'s rounds, which placed `todo[:start]`."""
        mask = (1 << shift) - 1
        if heap is None:
            heap = [(-int(x) << shift) | j for j, x in enumerate(free)]
        heapq.heapify(heap)
        needs = self._needs_list
        placed = [] if to is None else to[:start].tolist()
        for k in todo[start:].tolist():
            key = heap[0]
            need = needs[k]
            if -(key >> shift) < need:
                return None
            heapq.heapreplace(heap, key + (need << shift))
            placed.append(key & mask)
        assign[todo] = placed
        f = np.zeros(len(free), dtype=np.int64)
        for key in heap:
            f[key & mask] = -(key >> shift)
        return assign, f

    def _first_fit(self, free: np.ndarray, todo: np.ndarray, assign: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """First-fit decreasing on many devices, a run of pieces at a time: after a piece
        goes to device j (the first with room for it), the next pieces go to j too for as
        long as each fits in what j has left and is bigger than the most room any device
        before j has (none of those fits it): one cumulative sum places the whole run, the
        same assignment as one piece at a time. A thousand devices with many small pieces
        (most go to the first device with room) make the runs long."""
        f = np.asarray(free, dtype=np.int64).copy()
        needs = self.needs[todo]  # decreasing
        neg = -needs  # increasing, for searchsorted
        to = np.empty(len(todo), dtype=np.int64)
        n = len(todo)
        k = 0
        window = 64
        while k < n:
            need = needs[k]
            j = int((f >= need).argmax())
            room = int(f[j])
            if room < need:
                return None
            below = int(f[:j].max()) if j else -1  # every device before j has less room than `need`
            end = min(n, k + window)
            total = np.cumsum(needs[k:end])
            run = min(int(np.searchsorted(total, room, side="right")),  # fit in j one after another
                      int(np.searchsorted(neg[k:end], -below, side="left")))  # bigger than `below`
            to[k:k + run] = j
            f[j] = room - int(total[run - 1])
            window = min(4 * window, 4096) if run == end - k else 64  # a long run: look further next time
            k += run
        assign[todo] = to
        return assign, f

    def copy(self) -> LookAhead:
        """An independent copy of the proof (the pieces' sizes shared: they never change)."""
        new = copy.copy(self)
        new.pending, new.assign, new.slack = self.pending.copy(), self.assign.copy(), self.slack.copy()
        new._mends = dict(self._mends)
        return new

    def _repack(self, free: np.ndarray) -> bool:
        """Pack the pending pieces into `free` by the proof's fit, and where worst fit fails by
        first fit (worst fit spreads the pieces, and under tight memory it can leave no device
        room for a large piece first fit finds room for); adopt the packing found."""
        got = self._pack(free, self.fit)
        if got is None and self.fit == "worst" and not self.unpackable(free):  # (then first fit fails too)
            got = self._pack(free, "first")
        if got is None:
            return False
        self.assign, self.slack = got
        return True

    def forget(self, i: int) -> None:
        """Piece `i` is being placed: it is no longer pending (its slot in the proof is free)."""
        if not self.pending[i]:
            return
        self._mends = {}
        self.pending[i] = False
        self.num_pending -= 1
        if self._largest is not None and i in self._largest[2]:
            self._largest = None
        if self.valid:
            self.slack[self.assign[i]] += self.needs[i]

    # ------------------------------------------------------------------ the greedy's rule
    def choose(self, i: int, free: np.ndarray, preference: Sequence[int],
               more: Callable[[], Sequence[int]] | None = None) -> int:
        """The device for piece `i`: the first of `preference` and then of `more()` (asked
        for only when the preference does not do) that keeps the rest packable; updates the
        proof. Every device offered must have room for the piece. The caller then takes the
        memory."""
        need = int(self.needs[i])
        room = list(preference)
        if not room or free[room[0]] < need:
            raise ValueError("choose() needs preferred devices with room")
        pending_more = more

        def all_room() -> list[int]:
            nonlocal pending_more
            if pending_more is not None:
                room.extend(pending_more())
                pending_more = None
            return room

        was_valid = self.valid
        self._mends = {}  # the ledger rule's cache of mends: this rule changes the proof
        self.forget(i)
        # free bytes of the devices whose repack failed: a device with the same free bytes fails
        # too (the pending pieces pack into the same multiset of rooms), so it is not repacked
        failed: set[int] = set()
        if was_valid:
            first = room[0]
            if self.slack[first] >= need:
                self.slack[first] -= need
                return first
            self.repacks += 1
            if self._repack_after(free, first, need):
                return first
            failed.add(int(free[first]))
            for d in room[1:]:
                if self.slack[d] >= need:
                    self.slack[d] -= need
                    return d
            known = len(room)
            for d in all_room()[known:]:
                if self.slack[d] >= need:
                    self.slack[d] -= need
                    return d
            rest = room[1:]
        elif self.unpackable(free):
            # no packing of the pending pieces into `free` exists, so none into less room on any
            # device: every repack below would fail (an infeasible piece set: the greedy names it
            # at the piece that finds no room)
            return room[0]
        else:
            rest = all_room()
        for d in rest:
            if int(free[d]) in failed:
                continue
            self.repacks += 1
            if self._repack_after(free, d, need):
                self.valid = True
                return d
            failed.add(int(free[d]))
        self.valid = False
        return room[0]

    def _repack_after(self, free: np.ndarray, device: int, need: int) -> bool:
        f = free.copy()
        f[device] -= need
        return self._repack(f)

    # ------------------------------------------------------------------ the ledger's rule
    def _repair(self, device: int, need: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The proof with `need` more bytes used on `device`, mended instead of repacked: the
        pending pieces it holds on `device` move off (`_evict`) until `device`'s slack holds
        `need`. (assignment, slack), the slack already less `need` on `device`; None when the
        moves fall short (a repack from scratch may still find a packing). Every move puts a
        piece where the proof has room for it, so the mended proof is valid. A piece placed on
        another device than the proof held it frees its slot there, so the usual mend is a
        swap; under tight memory, where the slack seldom holds a piece and a device may be
        held for one piece of nearly its size, that piece goes to a device whose own pending
        pieces move elsewhere first (one link of a chain). O(pieces on the devices touched x
        devices), not O(pieces): it spares a repack of every pending piece at almost every
        placement there."""
        if not self.valid:
            return None
        key = (device, need)
        if key in self._mends:
            return self._mends[key]
        assign, slack = self.assign.copy(), self.slack.copy()
        where, sizes = assign[self.pending], self.needs[self.pending]
        if int(sizes.sum()) < 1 << 53:  # pending bytes the proof holds per device; exact in float64
            held = np.bincount(where, weights=sizes, minlength=len(slack)).astype(np.int64)
        else:
            held = np.zeros(len(slack), dtype=np.int64)
            np.add.at(held, where, sizes)
        got = None
        if self._evict(assign, slack, held, device, need - int(slack[device]), {device}, chain=1):
            slack[device] -= need
            got = assign, slack
        self._mends[key] = got
        return got

    def _evict(self, assign: np.ndarray, slack: np.ndarray, held: np.ndarray, device: int, deficit: int,
               keep: set[int], chain: int) -> bool:
        """Move pending pieces off `device` in (assign, slack, held), largest first, until its
        slack grew by `deficit`: each to the device outside `keep` with the most slack when that
        holds it, else (while `chain` > 0) to the device outside `keep` with the most slack among
        those whose slack and pending bytes together hold it, once its own pieces moved off
        enough to make room. Whether the deficit was met; moves made before a failure stay
        (each keeps the proof valid)."""
        if deficit <= 0:
            return True
        if held[device] < deficit:
            return False
        on = np.flatnonzero(self.pending & (assign == device))
        blocked = list(keep)
        for k in on[np.argsort(-self.needs[on], kind="stable")].tolist():
            size = self._needs_list[k]
            saved = slack[blocked].copy()
            slack[blocked] = np.iinfo(np.int64).min  # never a target
            to = int(slack.argmax())
            fits = slack[to] >= size
            if not fits and chain > 0:  # of the devices that could make room, the one with most slack
                could = np.where(slack + held >= size, slack, np.iinfo(np.int64).min)
                could[blocked] = np.iinfo(np.int64).min
                to = int(could.argmax())
                fits = could[to] > np.iinfo(np.int64).min
            slack[blocked] = saved
            if not fits:
                continue
            if slack[to] < size and not self._evict(assign, slack, held, to, size - int(slack[to]), keep | {to},
                                                    chain - 1):
                continue
            slack[to] -= size
            held[to] += size
            slack[device] += size
            held[device] -= size
            assign[k] = to
            deficit -= size
            if deficit <= 0:
                return True
        return False

    def packs_after(self, free: Sequence[int], device: int, need: int) -> bool:
        """Whether the pending pieces still pack once `need` more bytes are used on `device`
        (the piece placed already forgotten): by the proof's slack, else by the proof mended
        (`_repair`), else by first-fit decreasing from scratch. Changes nothing but a cache
        of the mends `took` may adopt."""
        if self.num_pending == 0 or (self.valid and self.slack[device] >= need):
            return True
        f = np.array(free, dtype=np.int64)
        f[device] -= need
        if self.unpackable(f):  # then neither a mend nor a repack finds a packing
            return False
        if self._repair(device, need) is not None:
            return True
        return self._pack(f, "first") is not None

    def took(self, free_after: Sequence[int], device: int, need: int) -> None:
        """`need` bytes were taken on `device` (`free_after`: free bytes now): keep the proof,
        mend it, or repack it on the memory as it is now."""
        if self.valid and self.slack[device] >= need:
            self.slack[device] -= need
            self._mends = {}
            return
        mended = self._repair(device, need)
        self._mends = {}
        if mended is not None:
            self.mends += 1
            self.assign, self.slack = mended
            return
        self.repacks += 1
        self.valid = self._repack(np.array(free_after, dtype=np.int64))
