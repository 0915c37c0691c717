"""Runtime settings, read from Horovod's environment variables (AIAK_* only for new knobs)."""
import os
from dataclasses import dataclass
from typing import Optional

from aiak_training.common.env import (env_bool, env_bytes, env_choice, env_float, env_int,
                                      env_optional_bool, env_str)
from aiak_training.common.tuning import (ALGORITHM_ALIASES, ALGORITHM_CHOICES,
                                         ALLREDUCE_ALGORITHM, CYCLE_TIME, FUSION_THRESHOLD,
                                         HIERARCHICAL_ALLREDUCE_VARIABLE, RESPONSE_CACHE)

#: Values of AIAK_ALLREDUCE_ALGO (the knob table's): ``auto`` lets the topology decide,
#: ``hierarchical`` means ``hier_pipelined``; the others name one algorithm of
#: :mod:`aiak_training.allreduce`.
ALLREDUCE_ALGOS = ALGORITHM_CHOICES
#: Earlier spellings, still accepted.
ALLREDUCE_ALGO_ALIASES = ALGORITHM_ALIASES

GPU_TRANSPORTS = ("nccl", "mpi")
LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")


def _allreduce_algo() -> str:
    name = env_choice(ALLREDUCE_ALGORITHM.variable, "auto",
                      ALLREDUCE_ALGOS + tuple(ALLREDUCE_ALGO_ALIASES))
    return ALLREDUCE_ALGO_ALIASES.get(name, name)


def gpu_transport_setting() -> str:
    """AIAK_GPU_TRANSPORT wins; otherwise HOROVOD_GPU_OPERATIONS (or HOROVOD_GPU_ALLREDUCE, its
    older per-op form) set to MPI asks for the MPI path."""
    explicit = env_choice("AIAK_GPU_TRANSPORT", "", GPU_TRANSPORTS)
    if explicit:
        return explicit
    for name in ("HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE"):
        value = env_choice(name, "", ("nccl", "mpi"))
        if value:
            return value
    return "nccl"


def _deadlock_shutdown() -> bool:
    """AIAK_DEADLOCK_SHUTDOWN when set; else on, unless the job chose Horovod's own stall
    rule by setting HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (0, "never", included)."""
    explicit = env_optional_bool("AIAK_DEADLOCK_SHUTDOWN")
    if explicit is not None:
        return explicit
    return not os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "").strip()


@dataclass
class Config:
    fusion_threshold: int = 128 * 1024 * 1024   # HOROVOD_FUSION_THRESHOLD, bytes
    cycle_time_ms: float = 1.0                   # HOROVOD_CYCLE_TIME
    cache_capacity: int = 1024                   # HOROVOD_CACHE_CAPACITY
    stall_check_disable: bool = False            # HOROVOD_STALL_CHECK_DISABLE
    stall_check_time_s: float = 60.0             # HOROVOD_STALL_CHECK_TIME_SECONDS
    stall_shutdown_time_s: float = 0.0           # HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
    # A certain deadlock (every rank waits, and none submitted or completed a collective for
    # the stall-warning time) ends the job with an error; Horovod waits forever.  On unless
    # the stall check is disabled or HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is set (then its
    # rule alone applies, as in Horovod); AIAK_DEADLOCK_SHUTDOWN=1 or 0 says so explicitly.
    deadlock_shutdown: bool = True
    timeline: Optional[str] = None               # HOROVOD_TIMELINE (path or DYNAMIC)
    timeline_mark_cycles: bool = False           # HOROVOD_TIMELINE_MARK_CYCLES
    # HOROVOD_HIERARCHICAL_ALLREDUCE: None when unset (the algorithm is chosen by topology),
    # True or False when the job says so.
    hierarchical_allreduce: Optional[bool] = None
    allreduce_algo: str = "auto"                 # AIAK_ALLREDUCE_ALGO
    dynamic_process_sets: bool = False           # HOROVOD_DYNAMIC_PROCESS_SETS
    # Tensors at least this large skip the fusion buffer and are reduced in place (no copies).
    zero_copy_bytes: int = 1024 * 1024           # AIAK_ZERO_COPY_BYTES
    log_level: str = "WARNING"                   # HOROVOD_LOG_LEVEL
    # How CUDA tensors travel: "nccl" (default; falls back to "mpi" where NCCL cannot run)
    # or "mpi" (staged through pinned host memory).  AIAK_GPU_TRANSPORT, or Horovod's
    # HOROVOD_GPU_OPERATIONS=MPI.
    gpu_transport: str = "nccl"
    # Collective watchdog (runtime/diagnostics/watchdog.py): an MPI operation of the engine
    # that shows no progress for this long ends the process (0: off).
    # AIAK_COLLECTIVE_TIMEOUT_SECONDS.
    collective_timeout_s: float = 30.0
    # The watchdog's liveness probe: a small TCP listener per rank that lets the watchdog name
    # the peers that are gone.  AIAK_LIVENESS_PROBE.
    liveness_probe: bool = True
    # After a cycle that found nothing in flight on any rank, the engine thread parks for up
    # to this long (0: never).  A thread that waits on a handle ends the park, and a
    # submission shortens it to one cycle time (time for the tensors that follow to join).
    # Each idle negotiation is a collective: over Gloo it costs hundreds of microseconds and a
    # wake-up of Gloo's worker thread, over MPI a wait for the slowest rank's cycle; on a busy
    # host both compete with the training threads for the cores.  AIAK_IDLE_PARK_MS.
    idle_park_ms: float = 5.0
    # MPI jobs: host allreduces of at least this many bytes run as the engine's own
    # segmented ring over point-to-point messages (csrc/engine/mpi.cpp), smaller ones as
    # MPI's nonblocking allreduce; 0 leaves every size to MPI.  AIAK_MPI_RING_BYTES.
    mpi_ring_bytes: int = 1024 * 1024
    # The ring's segment size and how many segments are in flight each way.
    mpi_ring_segment_bytes: int = 256 * 1024     # AIAK_MPI_RING_SEGMENT_BYTES
    mpi_ring_window: int = 4                     # AIAK_MPI_RING_WINDOW
    # The ring also for sets whose ranks share one host (where MPI's shared-memory
    # algorithms are used otherwise).  AIAK_MPI_RING_ON_ONE_HOST.
    mpi_ring_on_one_host: bool = False
    # MPI jobs: the engine waits for its MPI operations by testing them, spinning for 20 us
    # after any progress and then sleeping up to this long between tests, instead of MPI's
    # polling, which takes a core from compute for as long as a wait lasts; 0 spins.
    # AIAK_MPI_WAIT_SLEEP_US.
    mpi_wait_sleep_us: float = 100.0
    mpi_wait_spin_us: float = 20.0               # AIAK_MPI_WAIT_SPIN_US

    def __setattr__(self, name: str, value) -> None:
        # A running engine's C++ core holds copies of some settings (fusion threshold, ...): it
        # registers ``on_change`` to hear of changes made while it runs.
        object.__setattr__(self, name, value)
        listener = self.__dict__.get("on_change")
        if listener is not None and name != "on_change":
            listener(name, value)

    @classmethod
    def from_env(cls) -> "Config":
        return cls(
            fusion_threshold=env_int(FUSION_THRESHOLD.variable, cls.fusion_threshold,
                                     minimum=0),
            cycle_time_ms=env_float(CYCLE_TIME.variable, cls.cycle_time_ms, minimum=0.0),
            cache_capacity=env_int(RESPONSE_CACHE.variable, cls.cache_capacity, minimum=0),
            stall_check_disable=env_bool("HOROVOD_STALL_CHECK_DISABLE"),
            stall_check_time_s=env_float("HOROVOD_STALL_CHECK_TIME_SECONDS",
                                         cls.stall_check_time_s, minimum=0.0),
            stall_shutdown_time_s=env_float("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                            cls.stall_shutdown_time_s, minimum=0.0),
            deadlock_shutdown=_deadlock_shutdown(),
            timeline=env_str("HOROVOD_TIMELINE"),
            timeline_mark_cycles=env_bool("HOROVOD_TIMELINE_MARK_CYCLES"),
            hierarchical_allreduce=env_optional_bool(HIERARCHICAL_ALLREDUCE_VARIABLE),
            allreduce_algo=_allreduce_algo(),
            dynamic_process_sets=env_bool("HOROVOD_DYNAMIC_PROCESS_SETS"),
            zero_copy_bytes=env_bytes("AIAK_ZERO_COPY_BYTES", cls.zero_copy_bytes),
            log_level=env_choice("HOROVOD_LOG_LEVEL", "warning", LOG_LEVELS).upper(),
            gpu_transport=gpu_transport_setting(),
            collective_timeout_s=env_float("AIAK_COLLECTIVE_TIMEOUT_SECONDS",
                                           cls.collective_timeout_s, minimum=0.0),
            liveness_probe=env_bool("AIAK_LIVENESS_PROBE", True),
            idle_park_ms=env_float("AIAK_IDLE_PARK_MS", cls.idle_park_ms, minimum=0.0),
            mpi_ring_bytes=env_bytes("AIAK_MPI_RING_BYTES", cls.mpi_ring_bytes),
            mpi_ring_segment_bytes=env_bytes("AIAK_MPI_RING_SEGMENT_BYTES",
                                             cls.mpi_ring_segment_bytes),
            mpi_ring_window=env_int("AIAK_MPI_RING_WINDOW", cls.mpi_ring_window, minimum=1),
            mpi_ring_on_one_host=env_bool("AIAK_MPI_RING_ON_ONE_HOST"),
            mpi_wait_sleep_us=env_float("AIAK_MPI_WAIT_SLEEP_US", cls.mpi_wait_sleep_us,
                                        minimum=0.0),
            mpi_wait_spin_us=env_float("AIAK_MPI_WAIT_SPIN_US", cls.mpi_wait_spin_us,
                                       minimum=0.0),
        )


def removed_engine_choice() -> Optional[str]:
    """The deprecation warning for ``AIAK_ENGINE=python``, or None.

    ``AIAK_ENGINE`` chose between the C++ engine and a Python one until the Python engine was
    removed: ``native`` (or unset) is accepted, ``python`` still starts (on the C++ engine)
    with this warning for one release, and anything else is a ``ValueError``."""
    raw = os.environ.get("AIAK_ENGINE", "")
    choice = raw.strip().lower()
    if choice in ("", "native"):
        return None
    if choice == "python":
        return ("AIAK_ENGINE=python is deprecated and ignored: the Python engine was removed, "
                "and the C++ engine runs every job (MPI and Gloo). Unset AIAK_ENGINE; it "
                "will be an error in the next release.")
    raise ValueError(f"AIAK_ENGINE={raw!r}: expected native (the only engine; the Python "
                     "engine was removed).")
