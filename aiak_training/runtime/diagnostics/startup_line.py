"""Say what is on: one line from rank 0 when the runtime starts.

Switches such as ``aiakrun --overlap-update`` or ``--fused-optimizer`` act far from where
they are set (in the optimizer wrapper, at its first step), so a job gave no sign that they
took effect.  At ``hvd.init()`` rank 0 therefore states, in one line: the
transport (and the MPI library), the GPU transport CUDA tensors would really take (the same
answer as ``aiakrun --check-build``), the allreduce algorithm of the global set and why it was
chosen, and every acceleration that is on with what switched it on (an aiakrun flag sets the
variable named; a hierarchical allreduce may also be chosen by the topology).  Choices made in
code, per optimizer (overlap, compression, DGC, a fused optimizer), follow in one line when a
``DistributedOptimizer`` is made (:func:`announce`, used by the torch frontend).

Under aiakrun (``$AIAK_FAILURE_DIR`` set) the lines are shown unless the job asked for
``--log-level WARNING`` or higher (``HOROVOD_LOG_LEVEL``); elsewhere they are logged at INFO
(``HOROVOD_LOG_LEVEL=info``), so that programs run by hand stay as quiet as Horovod's.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional, Tuple

from aiak_training.allreduce import resolve_algorithm
from aiak_training.common.env import env_bool
from aiak_training.common.tuning import ALLREDUCE_ALGORITHM, FUSED_OPTIMIZER, OVERLAP_UPDATE

log = logging.getLogger("aiak_training")
_UNDER_AIAKRUN_ENV = "AIAK_FAILURE_DIR"  # set by aiakrun for every rank (runner/report/failure.py)

# Environment switches that turn an acceleration on, with how the line names them.
_SWITCHES = tuple((knob.variable, knob.title) for knob in (OVERLAP_UPDATE, FUSED_OPTIMIZER))


def _mpi_library() -> str:
    try:
        from mpi4py import MPI
        words = [w for w in MPI.Get_library_version().strip().splitlines()[0].split()
                 if w != "Version:"]
        return " ".join(words[:3]).rstrip(",")
    except Exception:  # noqa: BLE001 - only a description
        return "MPI"


# HOROVOD_LOG_LEVEL values that silence the lines (aiakrun --log-level WARNING and higher).
_QUIET_LEVELS = ("warning", "error", "fatal")


def visible_gpus() -> int:
    """CUDA devices this process could use; 0 when there is no driver or runtime."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    torch = sys.modules.get("torch")
    if torch is not None and getattr(getattr(torch, "version", None), "cuda", "") is None \
            and "tensorflow" not in sys.modules:
        return 0  # a CPU build of torch: CUDA tensors cannot exist, so do not load libcudart
    try:
        from aiak_training.common.gpu import cudart
        return int(cudart.runtime().device_count())
    except Exception:  # noqa: BLE001 - no driver, no runtime: no GPU
        return 0


def gpu_path(wanted: str, nccl_version: int, devices: int) -> Tuple[str, str]:
    """(transport, why) that CUDA tensors take: ``nccl``, ``mpi (staged)`` or ``none``.

    ``wanted`` is the setting (:func:`aiak_training.common.config.gpu_transport_setting`),
    ``nccl_version`` a loadable NCCL's version code (0: none), ``devices`` the visible GPUs.
    ``aiakrun --check-build`` and the start-up line both answer from here.
    """
    if devices < 1:
        nccl = "NCCL found" if nccl_version else "NCCL not found"
        return "none", f"no GPU visible; {nccl}"
    if wanted == "mpi":
        return "mpi (staged)", "asked for"
    if nccl_version:
        return "nccl", "NCCL found"
    return "mpi (staged)", "NCCL not found"


def _gpu_transport_part(config) -> str:
    devices = visible_gpus()
    if devices < 1:
        # Without a GPU the answer is "none" whatever NCCL is, so NCCL is not looked for: its
        # dlopen attempts cost rank 0 ~15 ms inside hvd.init() and let it fall behind its peers.
        return gpu_path(config.gpu_transport, 0, devices)[0]
    from aiak_training.common.host import build_info
    name, _why = gpu_path(config.gpu_transport, build_info.nccl_built(), devices)
    return name


def accelerations(environ=None) -> List[str]:
    """Names of the accelerations the environment switches on."""
    env = os.environ if environ is None else environ
    out = []
    for var, name in _SWITCHES:
        try:
            if env_bool(var, environ=env):
                out.append(f"{name} ({var})")
        except ValueError:
            continue  # the frontend reports a malformed value itself
    return out


def describe(engine) -> str:
    """The start-up line for a running engine (see the module docstring)."""
    topology = engine.topology
    transport = getattr(getattr(topology, "comm", None), "transport", "mpi")
    if transport == "gloo":
        parts = ["transport Gloo"]
    else:
        parts = [f"transport MPI ({_mpi_library()})"]
    parts.append(f"GPU collectives {_gpu_transport_part(engine.config)}")
    on: List[str] = []
    try:
        name, why = resolve_algorithm(engine.config, topology, is_global=True)
        state = engine.sets.get(0)
        actual = getattr(getattr(state, "algorithm", None), "name", None) or name
        parts.append(f"allreduce {actual} ({why}; {topology.num_nodes} node(s), "
                     f"{topology.size} rank(s))")
        if actual.startswith("hier"):
            on.append(f"hierarchical allreduce ({_hier_source(why)})")
    except Exception as exc:  # noqa: BLE001 - a description must not stop the job
        parts.append(f"allreduce ? ({exc})")
    on += accelerations()
    parts.append("accelerations: " + (", ".join(on) if on else "none"))
    if os.environ.get("AIAK_COMPAT_KERAS2") == "1":  # set by aiakrun (compat/keras2.py)
        parts.append("tf.keras is Keras 2 (tf_keras): TF_USE_LEGACY_KERAS=1 set by "
                     "--horovod-compat; TF_USE_LEGACY_KERAS=0 keeps Keras 3")
    return "; ".join(parts)


def _hier_source(why: str) -> str:
    """What switched a hierarchical allreduce on, from :func:`resolve_algorithm`'s reason."""
    if why.startswith(f"{ALLREDUCE_ALGORITHM.variable}=auto"):
        return "chosen by the topology: several nodes with several ranks"
    return why


def announce(text: str) -> None:
    """Show ``text`` as described in the module docstring."""
    if os.environ.get("HOROVOD_LOG_LEVEL", "").strip().lower() in _QUIET_LEVELS:
        return
    if os.environ.get(_UNDER_AIAKRUN_ENV) and not log.isEnabledFor(logging.INFO):
        try:
            sys.stderr.write(f"[aiak_training INFO] {text}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    else:
        log.info("%s", text)


def announce_start(engine) -> None:
    """Rank 0's start-up line (called by ``hvd.init()``)."""
    topology = getattr(engine, "topology", None)
    if topology is None or topology.rank != 0:
        return
    try:
        text = describe(engine)
    except Exception as exc:  # noqa: BLE001 - a description must not stop the job
        text = f"started (no description: {exc})"
    announce(text)


def optimizer_line(optimizer: object, compression: object, overlap: Optional[bool]) -> str:
    """``DistributedOptimizer(FusedAdam): compression fp16, overlap update on``."""
    comp = getattr(compression, "__name__", None) or type(compression).__name__
    comp = {"NoneCompressor": "none", "FP16Compressor": "fp16"}.get(comp, comp)
    name = type(optimizer).__name__
    fused = name.startswith("Fused") or "fused" in type(optimizer).__module__
    bits = [f"compression {comp}",
            f"overlap update {'on' if overlap else 'off'}",
            f"fused optimizer {'on' if fused else 'off'}"]
    return f"DistributedOptimizer({name}): " + ", ".join(bits)


def announce_optimizer(optimizer: object, compression: object, overlap: Optional[bool]) -> None:
    """Rank 0's line for a new ``DistributedOptimizer`` (see :func:`optimizer_line`)."""
    try:
        from aiak_training.runtime import current
        if current.topology().rank != 0:
            return
        announce(optimizer_line(optimizer, compression, overlap))
    except Exception:  # noqa: BLE001 - a description must not stop the job
        return
