"""Starting and stopping the runtime, and the questions about the job's layout.

These are the framework-independent calls of the ``hvd`` API (``init``, ``rank``,
``size``, ...); each frontend re-exports them.  One engine per process: ``init`` starts it,
``shutdown`` stops it, and every collective goes through :func:`engine`.
"""
import atexit
import logging
import os
import sys
import threading
from typing import Dict, List, Optional, Sequence, Union

from aiak_training.common import horovod_strings as hs
from aiak_training.common.config import Config, removed_engine_choice
from aiak_training.common.env import env_bool
from aiak_training.common.host import build_info
from aiak_training.common.job import exit_guard as _exit_guard
from aiak_training.common.messages import OpType
from aiak_training.runtime import autotune as _autotune
from aiak_training.runtime import current
from aiak_training.runtime.current import engine, is_initialized  # noqa: F401 - re-exported
from aiak_training.runtime.diagnostics import startup_line as _startup_line
from aiak_training.runtime.engine import Engine
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.runtime.transport import gloo as _gloo

_state_lock = threading.Lock()
_atexit_registered = False
log = logging.getLogger("aiak_training")


def _configure_logging(level: str) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        # HOROVOD_LOG_HIDE_TIME (aiakrun --log-without-timestamp) drops the time, as in Horovod.
        stamp = "" if env_bool("HOROVOD_LOG_HIDE_TIME") else "%(asctime)s "
        handler.setFormatter(logging.Formatter(f"[{stamp}aiak_training %(levelname)s] %(message)s"))
        log.addHandler(handler)
    log.setLevel({"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(level, level))


def _base_communicator(comm):
    """The MPI communicator the job runs on, from ``init``'s ``comm`` argument."""
    from mpi4py import MPI
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm):
        return comm
    if isinstance(comm, (list, tuple)):
        ranks = sorted(int(r) for r in comm)
        group = MPI.COMM_WORLD.Get_group().Incl(ranks)
        base = MPI.COMM_WORLD.Create(group)  # collective over COMM_WORLD
        group.Free()
        if base == MPI.COMM_NULL:
            raise ValueError(f"Horovod initialization failed: rank "
                             f"{MPI.COMM_WORLD.Get_rank()} is not in comm={ranks}.")
        return base
    raise ValueError(f"init(comm=...) expects None, a list of ranks or an mpi4py "
                     f"communicator, got {type(comm).__name__}.")


def init(comm=None, process_sets: Optional[Union[Sequence[ProcessSet], str]] = None) -> None:
    """Start the runtime on this process.  Every process of the job must call it.

    ``comm`` picks the processes: None for all of ``MPI_COMM_WORLD``, a list of its ranks,
    or an mpi4py communicator (which is duplicated, never used directly).
    ``process_sets`` is None, a list of :class:`ProcessSet` to create now (the same list on
    every process), or ``"dynamic"`` to allow :func:`add_process_set` and
    :func:`remove_process_set` later.  The same ranks may not appear twice (nor all ranks,
    which are the global set): that is Horovod's ``ValueError`` naming the entry's number.
    A second call while running starts nothing; as in Horovod, the process sets it is given
    take the ids of the registered sets with their ranks (one that is not registered is a
    ``ValueError``: register it with ``add_process_set``, or shut down first).  After
    :func:`shutdown`, ``init`` starts a fresh runtime.
    """
    global _atexit_registered
    from mpi4py import MPI
    with _state_lock:
        if current.is_initialized():
            if process_sets is not None and not isinstance(process_sets, str):
                _adopt_registered_sets(list(process_sets))
            return
        config = Config.from_env()
        _configure_logging(config.log_level)
        engine_warning = removed_engine_choice()
        if engine_warning:
            log.warning(engine_warning)
        use_gloo = _gloo.gloo_selected()
        if env_bool("HOROVOD_MPI_THREADS_DISABLE") and not use_gloo and \
                MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            log.warning("HOROVOD_MPI_THREADS_DISABLE=1 has no effect: MPI was initialized with "
                        "MPI_THREAD_MULTIPLE before aiak_training was imported (import "
                        "aiak_training before mpi4py.MPI to honour it).")
        if isinstance(process_sets, str) and process_sets.lower() == "dynamic":
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
            config.dynamic_process_sets = True
            process_sets = None
        base = _gloo.base_communicator(comm) if use_gloo else _base_communicator(comm)
        static: List[List[int]] = []
        for ps in process_sets or ():
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"process_sets must contain ProcessSet objects, got {ps!r}.")
            static.append(ps.resolve_ranks(base))
        # Every rank checks the same list, so all refuse it together, before anything starts.
        _check_no_duplicates(list(process_sets or ()), static, base.Get_size())
        if use_gloo:
            _gloo.configure(config)
        started = Engine(base, config, static)
        started.start()
        current.install(started)
        _startup_line.announce_start(started)  # rank 0: engine, transport, algorithm, switches
        _autotune.start(started)  # HOROVOD_AUTOTUNE: attach the tuner (runtime/autotune/)
        global_process_set.ranks = list(range(started.topology.size))
        global_process_set.process_set_id = 0
        for set_id, ps in enumerate(process_sets or (), start=1):
            ps.process_set_id = set_id
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def _duplicate_error(index: int, ps: ProcessSet) -> ValueError:
    ps.process_set_id = None
    return ValueError(f"Horovod could not be initialized because process_sets entry number "
                      f"{index} is a duplicate: {ps}")


def _check_no_duplicates(process_sets: List[ProcessSet], ranks: List[List[int]],
                         world_size: int) -> None:
    """Horovod's rule: each entry's ranks differ from the global set's and every earlier
    entry's."""
    seen = {tuple(range(world_size))}
    for index, (ps, members) in enumerate(zip(process_sets, ranks)):
        key = tuple(sorted(members))
        if key in seen:
            raise _duplicate_error(index, ps)
        seen.add(key)


def _adopt_registered_sets(process_sets: List[ProcessSet]) -> None:
    """``init(process_sets=...)`` while running: give each set the id of the registered set
    with its ranks, as Horovod's second ``init`` does."""
    running = current.engine()
    by_ranks = {tuple(r): set_id for set_id, r in running.process_set_table().items()}
    seen = {0}
    for index, ps in enumerate(process_sets):
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets must contain ProcessSet objects, got {ps!r}.")
        members = tuple(sorted(ps.resolve_ranks(running._parent_comm)))
        set_id = by_ranks.get(members)
        if set_id is None:
            raise ValueError(
                f"hvd.init(process_sets=...) was called while Horovod is running, and "
                f"process_sets entry number {index} ({ps}) is not a registered process set: "
                "a running job cannot create process sets through init. Register it with "
                "hvd.add_process_set (HOROVOD_DYNAMIC_PROCESS_SETS=1), or call "
                "hvd.shutdown() before hvd.init(process_sets=...).")
        if set_id in seen:
            raise _duplicate_error(index, ps)
        seen.add(set_id)
        ps.process_set_id = set_id


def shutdown() -> None:
    """Stop the runtime on this process.  Operations still in flight fail with
    ``HorovodInternalError``; peers see this process leave and stop too."""
    with _state_lock:
        stopping = current.install(None)
    if stopping is not None:
        # A still-running engine means the program ended normally; one that stopped by
        # itself failed or was stopped by a peer (common/job/exit_guard.py bounds the exit then).
        _exit_guard.note_shutdown(stopping.running)
        stopping.shutdown()
        _gloo.release(getattr(stopping, "_parent_comm", None))  # Gloo: connections close now


def size() -> int:
    """How many processes the job has."""
    return current.topology().size


def rank() -> int:
    """This process's index in the job, from 0 to ``size() - 1``."""
    return current.topology().rank


def local_size() -> int:
    """How many processes of the job run on this machine."""
    return current.topology().local_size


def local_rank() -> int:
    """This process's index among the job's processes on this machine (use it to pick a
    GPU)."""
    return current.topology().local_rank


def cross_size() -> int:
    """How many machines run a process with this process's ``local_rank``."""
    return current.topology().cross_size


def cross_rank() -> int:
    """The index of this machine among those counted by :func:`cross_size`."""
    return current.topology().cross_rank


def is_homogeneous() -> bool:
    """Whether every machine runs the same number of the job's processes."""
    return current.topology().is_homogeneous


def mpi_threads_supported() -> bool:
    """Whether MPI was started with ``MPI_THREAD_MULTIPLE`` (other threads may then use MPI
    too, e.g. through mpi4py)."""
    from mpi4py import MPI
    if gloo_enabled():
        engine()
        return False  # no MPI in a Gloo job
    engine()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """Whether the job talks over MPI (before ``init``: whether ``init`` would use it)."""
    return not gloo_enabled()


def gloo_enabled() -> bool:
    """Whether the job talks over Gloo (``aiakrun --gloo``, ``HOROVOD_CONTROLLER=gloo``);
    before ``init``: whether ``init`` would use it."""
    if _gloo.world_active():
        return True
    return not current.is_initialized() and _gloo.gloo_selected()


def _build_flag(name: str):
    def flag():
        return getattr(build_info, name)()
    flag.__name__ = name
    flag.__doc__ = f"The {name} answer of `aiakrun --check-build`."
    return flag


mpi_built = _build_flag("mpi_built")
gloo_built = _build_flag("gloo_built")
nccl_built = _build_flag("nccl_built")
ddl_built = _build_flag("ddl_built")
ccl_built = _build_flag("ccl_built")
cuda_built = _build_flag("cuda_built")
rocm_built = _build_flag("rocm_built")


# ---- read-only counters (leak checks) -------------------------------------------------------
def open_handles() -> int:
    """How many of this rank's submitted operations have not been synchronized yet (in flight,
    or done but never waited for).  A training loop that synchronizes everything it starts
    sees 0 between steps; a count that grows step after step is a leak."""
    return engine().open_handles()


def runtime_counts() -> Dict[str, int]:
    """Sizes of the runtime's tables on this rank (see ``Engine.counts``): open handles,
    pending entries, response-cache entries, negotiation tables, process sets, fusion-buffer
    bytes.  For soak tests and monitoring; reading them changes nothing."""
    return engine().counts()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline of every collective into ``file_path`` (written by
    rank 0).  ``mark_cycles`` adds a marker at every engine cycle.  Needs
    ``HOROVOD_TIMELINE`` (a path, or ``DYNAMIC``) set before ``init``."""
    running = engine()
    if not running.config.timeline:
        raise ValueError(hs.TIMELINE_NOT_DYNAMIC)
    if running.topology.rank == 0:
        running.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    running = engine()
    if running.topology.rank == 0:
        running.timeline.stop()


# ---- process sets -------------------------------------------------------------------------
def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Create a process set while the job runs, and return it ready to use.

    Every process of the job must call this, with the same ranks and in the same order.
    Needs dynamic process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or
    ``init(process_sets="dynamic")``).  A set with these ranks must not exist yet.
    """
    from mpi4py import MPI
    running = engine()
    if not running.config.dynamic_process_sets:
        raise ValueError(hs.ADD_PROCESS_SET_DISABLED)
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = process_set.resolve_ranks(MPI.COMM_WORLD)
    if process_set.process_set_id is not None or running.find_process_set(ranks) is not None:
        raise ValueError(f"A process set with ranks {ranks} has already been registered.")
    if not ranks or ranks[0] < 0 or ranks[-1] >= running.topology.size:
        raise ValueError(f"Process set ranks {ranks} are out of range for size "
                         f"{running.topology.size}.")
    set_id = running.run_control(0, OpType.ADD_PROCESS_SET, f"add_process_set.{ranks}",
                                 tuple(ranks))
    process_set.process_set_id = set_id
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Delete a process set created by :func:`add_process_set` or ``init``; True if it
    existed.  Collective like :func:`add_process_set`.  The global set stays."""
    running = engine()
    if not running.config.dynamic_process_sets:
        raise ValueError(hs.REMOVE_PROCESS_SET_DISABLED)
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or set_id not in running.process_set_ids():
        return False
    removed = running.run_control(0, OpType.REMOVE_PROCESS_SET, f"remove_process_set.{set_id}",
                                  (set_id,))
    if removed:
        process_set.process_set_id = None
    return bool(removed)
