"""A short soak at 2 ranks: handles, pending entries, negotiation tables, the response cache,
the output pool and the process-set tables stay bounded and return to idle between steps
(tests/scripts/soak_check.py; the long run is benchmarks/soak_bench.py)."""
import sys

import pytest

from launch import run_ranks


@pytest.mark.parametrize("env", [
    {},
    # A cache smaller than the working set: every step evicts and renegotiates.
    {"HOROVOD_CACHE_CAPACITY": "16"},
], ids=["default", "tiny_cache"])
def test_runtime_tables_stay_bounded(env):
    proc = run_ranks([2], [sys.executable, "tests/scripts/soak_check.py", "200"], env=env,
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.stdout.count("soak check passed") == 2, proc.stdout[-3000:]
