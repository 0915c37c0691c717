"""The table of knobs: every setting autotune or the advisor may choose, and how it is set.

A row (:class:`Knob`) says what a knob is called, which environment variables set it (Horovod's
and ours; the first is the one its flag sets), its ``aiakrun`` flag, the values autotune tries,
when a change takes effect (:data:`AT_START`, :data:`AT_STEP` or :data:`IN_SCRIPT`) and
whether autotune and the advisor vary it.  The names and values here are the only copy in the
package: readers take them from the rows (tests/test_knob_table.py fails a module that spells
one of them out).
"""
from dataclasses import dataclass
from typing import Optional, Tuple

MB = 1024 * 1024

#: How a knob takes effect: read once when the runtime (or the optimizer wrapper) starts;
#: switchable by autotune at a step boundary, with nothing of the global set in flight; or
#: only by a change to the training script.
AT_START = "at start"
AT_STEP = "at a step boundary"
IN_SCRIPT = "in the script"

#: The allreduce algorithms (aiak_training.allreduce builds each by this name).
ALGORITHMS = ("flat", "hier_staged", "hier_pipelined")
#: What the algorithm's variable and flag accept: ``auto`` lets the topology decide,
#: ``hierarchical`` means ``hier_pipelined``, the others name one of :data:`ALGORITHMS`.
ALGORITHM_CHOICES = ("auto", "flat", "hierarchical", "hier_staged", "hier_pipelined")
#: Earlier spellings, still accepted.
ALGORITHM_ALIASES = {"horovod-hier": "hier_staged", "aiak-hier": "hier_pipelined"}


@dataclass(frozen=True)
class Knob:
    name: str                    # the field of autotune's Setting / the advisor's row
    title: str                   # how messages name it
    env: Tuple[str, ...]         # variables that set (or fix) it; the flag sets env[0]
    flag: Optional[str]          # aiakrun's flag, None where the script must change
    candidates: Tuple = ()       # values tried (the fusion threshold in MiB)
    applied: str = AT_START      # AT_START, AT_STEP or IN_SCRIPT
    autotune: bool = False       # autotune varies it while the job runs
    advisor: bool = False        # the advisor's table has rows with and without it
    script: Optional[str] = None  # the script change that turns it on (IN_SCRIPT knobs)

    @property
    def variable(self) -> str:
        """The variable the flag sets."""
        return self.env[0]


FUSION_THRESHOLD = Knob(
    "fusion_threshold", "fusion threshold", ("HOROVOD_FUSION_THRESHOLD",),
    "--fusion-threshold-mb",
    # Reaches the 128 MB default (Horovod's search stops at 64 MB).
    candidates=(1, 4, 16, 32, 64, 128), applied=AT_STEP, autotune=True)
CYCLE_TIME = Knob(
    "cycle_time_ms", "cycle time", ("HOROVOD_CYCLE_TIME",), "--cycle-time-ms",
    # Horovod's range where it matters: slower cycles only add latency to every step.
    candidates=(1.0, 2.5, 5.0, 10.0, 25.0), applied=AT_STEP, autotune=True)
RESPONSE_CACHE = Knob(
    "cache_enabled", "response cache", ("HOROVOD_CACHE_CAPACITY",), "--cache-capacity",
    candidates=(True, False), applied=AT_STEP, autotune=True)
#: Horovod's on/off switch for the hierarchy, which also fixes the algorithm knob.
HIERARCHICAL_ALLREDUCE_VARIABLE = "HOROVOD_HIERARCHICAL_ALLREDUCE"
ALLREDUCE_ALGORITHM = Knob(
    "algorithm", "allreduce algorithm",
    ("AIAK_ALLREDUCE_ALGO", HIERARCHICAL_ALLREDUCE_VARIABLE), "--allreduce-algo",
    candidates=ALGORITHMS, applied=AT_STEP, autotune=True, advisor=True)
OVERLAP_UPDATE = Knob(
    "overlap", "overlap update", ("AIAK_OVERLAP_UPDATE",), "--overlap-update",
    candidates=(False, True), advisor=True)
FUSED_OPTIMIZER = Knob(
    "fused", "fused optimizer", ("AIAK_FUSED_OPTIMIZER",), "--fused-optimizer",
    candidates=(False, True), advisor=True)
DGC = Knob(
    "dgc", "DGC compression", (), None, candidates=(False, True), applied=IN_SCRIPT,
    advisor=True, script="compression=hvd.Compression.dgc()")

#: Every knob: the engine's, then the optimizer's, then those of the script.
KNOBS = (FUSION_THRESHOLD, CYCLE_TIME, ALLREDUCE_ALGORITHM, RESPONSE_CACHE, OVERLAP_UPDATE,
         FUSED_OPTIMIZER, DGC)


def knob(name: str) -> Knob:
    """The row named ``name``."""
    for row in KNOBS:
        if row.name == name:
            return row
    raise KeyError(f"no knob {name!r}; the table has {[k.name for k in KNOBS]}")
