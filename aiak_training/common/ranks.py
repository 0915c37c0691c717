"""Horovod's rank-and-size record: one process's place in a world, globally, on its host
(local) and among the processes that share its local rank (cross).

Shared by the elastic driver's rank assignment and the Gloo transport's world description, so
both speak of a worker's place with the same six fields in the same order.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
