"""The engine's ring allreduce over MPI (csrc/engine/mpi.cpp), launched on several layouts.

tests/scripts/mpi_ring.py checks every dtype and reduction exactly on uneven sizes, on the
global set and on a process set, and that each allreduce really ran as the ring.  The ring
does not depend on where ranks live, but the layouts are those of the hierarchical tests, the
job's algorithm forced flat (the ring is the flat algorithm's data path over MPI).
"""
import sys

import pytest

from launch import run_ranks

LAYOUTS = {"1x2": [2], "3x1": [1, 1, 1], "2+1": [2, 1], "2x2": [2, 2], "4x1": [1, 1, 1, 1]}

# Small segments and a window of 2, so that chunks split into several unequal segments and
# the window's reuse of its buffers is exercised; the ring also where the ranks share a host.
RING = {"AIAK_MPI_RING_BYTES": "1", "AIAK_MPI_RING_SEGMENT_BYTES": "4096",
        "AIAK_MPI_RING_WINDOW": "2", "AIAK_ALLREDUCE_ALGO": "flat",
        "AIAK_MPI_RING_ON_ONE_HOST": "1"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ring_allreduce_is_exact(layout):
    nodes = LAYOUTS[layout]
    proc = run_ranks(nodes, [sys.executable, "tests/scripts/mpi_ring.py"], env=RING,
                     virtual_hosts=len(nodes) > 1, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    oks = proc.stdout.count("RING OK")
    assert oks == sum(nodes), proc.stdout[-4000:]


def test_ring_with_large_segments_and_default_window():
    """The defaults' segment (256 KiB) on tensors of a few MB: whole chunks in one segment
    for the small ones, several for the large."""
    env = dict(RING, AIAK_MPI_RING_SEGMENT_BYTES="256K", AIAK_MPI_RING_WINDOW="4")
    proc = run_ranks([3], [sys.executable, "tests/scripts/mpi_ring.py", "--large"], env=env,
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("RING OK") == 3, proc.stdout[-4000:]
