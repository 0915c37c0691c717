"""Which slots an elastic job uses: host order, blacklist with cool-down, rank assignment.

Pure logic (no processes), so the driver's decisions can be unit-tested.
"""
from __future__ import annotations

import random
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from aiak_training.common.job.ranks import RankIdentity, place_ranks

Slot = Tuple[str, int]  # (host, index of the slot on that host)


class HostOrder:
    """Hosts in the order they were first discovered.  Ranks follow this order, so hosts
    that were already in the job keep the lowest ranks and rank 0 (whose state every new
    rank receives) stays on a host that holds the committed state."""

    def __init__(self) -> None:
        self._order: List[str] = []

    def update(self, hosts: Iterable[str]) -> None:
        for host in hosts:
            if host not in self._order:
                self._order.append(host)

    def __iter__(self):
        return iter(self._order)


class Blacklist:
    """Hosts whose workers failed.  Without a cool-down range a host stays out for good;
    with ``(low, high)`` it comes back after a random delay in that range, doubled for each
    further failure and capped at ``high``."""

    def __init__(self, cooldown: Optional[Tuple[float, float]] = None,
                 clock: Optional[Callable[[], float]] = None,
                 rng: Optional[random.Random] = None):
        import time
        self.cooldown = cooldown
        self._clock = clock or time.monotonic
        self._rng = rng or random.Random()
        self._until: Dict[str, float] = {}
        self._count: Dict[str, int] = {}

    def add(self, host: str) -> float:
        """Blacklist ``host`` now; returns the seconds it stays out (inf without cool-down)."""
        self._count[host] = self._count.get(host, 0) + 1
        if self.cooldown is None:
            delay = float("inf")
        else:
            low, high = self.cooldown
            delay = min(high, self._rng.uniform(low, high) * 2 ** (self._count[host] - 1))
        self._until[host] = self._clock() + delay
        return delay

    def blocked(self) -> Set[str]:
        now = self._clock()
        return {host for host, until in self._until.items() if until > now}

    def __contains__(self, host: str) -> bool:
        return host in self.blocked()


def plan_slots(order: Iterable[str], available: Dict[str, int], blocked: Set[str],
               max_np: Optional[int]) -> List[Slot]:
    """The slots the job should run on: available, not blacklisted hosts in host order,
    each with its slots, up to ``max_np`` in total."""
    slots: List[Slot] = []
    for host in order:
        if host not in available or host in blocked:
            continue
        for index in range(available[host]):
            if max_np is not None and len(slots) >= max_np:
                return slots
            slots.append((host, index))
    return slots


def assign_ranks(slots: Sequence[Slot]) -> Dict[Slot, RankIdentity]:
    """Each slot's placement in one round's world: ranks in slot order (plan_slots keeps a
    host's slots together), local and cross ranks by Horovod's rules (see place_ranks)."""
    return dict(zip(slots, place_ranks([host for host, _ in slots])))
