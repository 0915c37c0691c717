"""Runtime settings, read from Horovod's environment variables (AIAK_* only for new knobs)."""
import os
from dataclasses import dataclass
from typing import Optional


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"Environment variable {name}={value!r} is not a number.") from None


def env_int(name: str, default: int) -> int:
    return int(_env_float(name, default))


def env_flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _env_switch(name: str) -> Optional[bool]:
    """A numeric on/off variable, as Horovod reads it (> 0 is on), or None when unset."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return env_int(name, 0) > 0


# auto/flat/hierarchical are the user-facing choices; horovod-hier and aiak-hier name the
# two hierarchical algorithms explicitly (hierarchical means aiak-hier).
ALLREDUCE_ALGOS = ("auto", "flat", "hierarchical", "horovod-hier", "aiak-hier")


GPU_TRANSPORTS = ("nccl", "mpi")


def _gpu_transport() -> str:
    """AIAK_GPU_TRANSPORT wins; otherwise HOROVOD_GPU_OPERATIONS (or HOROVOD_GPU_ALLREDUCE, its
    older per-op form) set to MPI asks for the MPI path."""
    value = os.environ.get("AIAK_GPU_TRANSPORT", "").strip().lower()
    if value:
        if value not in GPU_TRANSPORTS:
            raise ValueError(f"AIAK_GPU_TRANSPORT={value!r}: expected one of "
                             f"{', '.join(GPU_TRANSPORTS)}.")
        return value
    for name in ("HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE"):
        value = os.environ.get(name, "").strip().upper()
        if value == "MPI":
            return "mpi"
        if value and value != "NCCL":
            raise ValueError(f"{name}={value!r}: aiak_training supports NCCL or MPI.")
    return "nccl"


@dataclass
class Config:
    fusion_threshold: int = 128 * 1024 * 1024   # HOROVOD_FUSION_THRESHOLD, bytes
    cycle_time_ms: float = 1.0                   # HOROVOD_CYCLE_TIME
    cache_capacity: int = 1024                   # HOROVOD_CACHE_CAPACITY
    stall_check_disable: bool = False            # HOROVOD_STALL_CHECK_DISABLE
    stall_check_time_s: float = 60.0             # HOROVOD_STALL_CHECK_TIME_SECONDS
    stall_shutdown_time_s: float = 0.0           # HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
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

    @classmethod
    def from_env(cls) -> "Config":
        cfg = cls(
            fusion_threshold=env_int("HOROVOD_FUSION_THRESHOLD", cls.fusion_threshold),
            cycle_time_ms=_env_float("HOROVOD_CYCLE_TIME", cls.cycle_time_ms),
            cache_capacity=env_int("HOROVOD_CACHE_CAPACITY", cls.cache_capacity),
            stall_check_disable=env_flag("HOROVOD_STALL_CHECK_DISABLE"),
            stall_check_time_s=_env_float("HOROVOD_STALL_CHECK_TIME_SECONDS", cls.stall_check_time_s),
            stall_shutdown_time_s=_env_float("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                             cls.stall_shutdown_time_s),
            timeline=os.environ.get("HOROVOD_TIMELINE") or None,
            timeline_mark_cycles=env_flag("HOROVOD_TIMELINE_MARK_CYCLES"),
            hierarchical_allreduce=_env_switch("HOROVOD_HIERARCHICAL_ALLREDUCE"),
            allreduce_algo=os.environ.get("AIAK_ALLREDUCE_ALGO", "auto").strip().lower() or "auto",
            dynamic_process_sets=env_flag("HOROVOD_DYNAMIC_PROCESS_SETS"),
            zero_copy_bytes=env_int("AIAK_ZERO_COPY_BYTES", cls.zero_copy_bytes),
            log_level=os.environ.get("HOROVOD_LOG_LEVEL", "WARNING").upper(),
            gpu_transport=_gpu_transport(),
        )
        if cfg.allreduce_algo not in ALLREDUCE_ALGOS:
            raise ValueError(f"AIAK_ALLREDUCE_ALGO={cfg.allreduce_algo!r}: expected one of "
                             f"{', '.join(ALLREDUCE_ALGOS)}.")
        if cfg.fusion_threshold < 0:
            raise ValueError("HOROVOD_FUSION_THRESHOLD must be >= 0.")
        return cfg
