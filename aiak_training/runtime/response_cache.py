"""Response cache: lets steady-state negotiation be one bit-vector allreduce per cycle.

Every rank inserts the same responses in the same order, so a tensor name maps to the same
bit on every rank without any extra communication.  Each rank also keeps its own request
signature beside the response: a later request with the same name but a different shape,
dtype, op, scale, root or splits is INVALID and forces a renegotiation on every rank.
"""
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from aiak_training.common.messages import OpType, Request, Response

CACHEABLE = frozenset({OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST, OpType.ALLTOALL,
                       OpType.REDUCESCATTER})

HIT, MISS, INVALID = "hit", "miss", "invalid"


class ResponseCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slots: List[Optional[Tuple[Response, Optional[tuple]]]] = [None] * capacity
        self._bit_of: Dict[str, int] = {}
        self._lru: "OrderedDict[int, None]" = OrderedDict()  # least recently used first
        self.active = True  # autotune's on/off knob; the capacity (bit vector size) stays

    @property
    def enabled(self) -> bool:
        return self.capacity > 0 and self.active

    def set_active(self, on: bool) -> None:
        """Turn the cache on or off.  Off empties it, so that when it comes back on every
        rank starts from the same (empty) cache."""
        if not on:
            for bit in list(self._lru):
                self.evict(bit)
        self.active = on

    def __len__(self) -> int:
        """How many responses the cache holds now (at most ``capacity``)."""
        return len(self._bit_of)

    def lookup(self, request: Request) -> Tuple[str, Optional[int]]:
        bit = self._bit_of.get(request.name)
        if bit is None:
            return MISS, None
        _, signature = self._slots[bit]
        if signature != request.signature():
            return INVALID, bit
        return HIT, bit

    def response(self, bit: int) -> Response:
        return self._slots[bit][0]

    def touch(self, bit: int) -> None:
        self._lru.move_to_end(bit)

    def put(self, response: Response, signature: Optional[tuple]) -> Optional[int]:
        """Insert a single-tensor response.  Called in the same order on every rank.

        Returns the bit evicted to make room, if any: a request waiting on that bit must be
        renegotiated, because the bit now belongs to another tensor."""
        evicted = None
        if not self.enabled or response.op_type not in CACHEABLE or len(response.names) != 1:
            return None
        name = response.names[0]
        bit = self._bit_of.get(name)
        if bit is not None and self._slots[bit][0] is response:
            # A cache hit that just ran: negotiation matched its signature and touched it.
            return None
        if bit is None:
            if len(self._bit_of) >= self.capacity:
                evicted = next(iter(self._lru))
                self.evict(evicted)
            bit = self._slots.index(None)  # lowest free bit: identical on every rank
            self._bit_of[name] = bit
        self._slots[bit] = (response, signature)
        self._lru[bit] = None
        self._lru.move_to_end(bit)
        return evicted

    def evict(self, bit: int) -> None:
        entry = self._slots[bit]
        if entry is None:
            return
        del self._bit_of[entry[0].names[0]]
        self._slots[bit] = None
        self._lru.pop(bit, None)

    def clear(self) -> None:
        self.__init__(self.capacity)
