"""init / shutdown / topology queries: the framework-independent part of the hvd API."""
import atexit
import logging
import os
import sys
import threading
from typing import List, Optional, Sequence, Union

from aiak_training.common.config import Config, env_flag
from aiak_training.common.engine import Engine, TensorEntry
from aiak_training.common.exceptions import NOT_INITIALIZED_MESSAGE
from aiak_training.common.messages import OpType, Request
from aiak_training.common.process_sets import ProcessSet, global_process_set

_state_lock = threading.Lock()
_engine_instance: Optional[Engine] = None
_atexit_registered = False
log = logging.getLogger("aiak_training")


def _configure_logging(level: str) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        # HOROVOD_LOG_HIDE_TIME (aiakrun --log-without-timestamp) drops the time, as in Horovod.
        stamp = "" if env_flag("HOROVOD_LOG_HIDE_TIME") else "%(asctime)s "
        handler.setFormatter(logging.Formatter(f"[{stamp}aiak_training %(levelname)s] %(message)s"))
        log.addHandler(handler)
    log.setLevel({"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(level, level))


def _engine() -> Engine:
    engine = _engine_instance
    if engine is None or not engine.running:
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    return engine


def _topology():
    """The rank layout of an initialized engine.  Like Horovod's rank() and size(), it keeps
    answering after a peer has shut the job down, until this process calls shutdown()."""
    engine = _engine_instance
    if engine is None or engine.topology is None:
        raise ValueError(NOT_INITIALIZED_MESSAGE)
    return engine.topology


def init(comm=None, process_sets: Optional[Union[Sequence[ProcessSet], str]] = None) -> None:
    """A function that initializes Horovod.

    Args:
      comm: One of these possibilities:
        1) List specifying ranks for the communicator, relative to the MPI_COMM_WORLD
          communicator.
        2) None: Use all ranks of MPI_COMM_WORLD.
        3) MPI communicator to use. Given communicator will be duplicated.
      process_sets: Either None to use only the global process set, a list of ProcessSet
        objects to be registered statically, or the string "dynamic" to enable
        hvd.add_process_set() and hvd.remove_process_set() at any time.
    """
    global _engine_instance, _atexit_registered
    from mpi4py import MPI
    with _state_lock:
        if _engine_instance is not None and _engine_instance.running:
            return
        config = Config.from_env()
        _configure_logging(config.log_level)
        if env_flag("HOROVOD_MPI_THREADS_DISABLE") and \
                MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            log.warning("HOROVOD_MPI_THREADS_DISABLE=1 has no effect: MPI was initialized with "
                        "MPI_THREAD_MULTIPLE before aiak_training was imported (import "
                        "aiak_training before mpi4py.MPI to honour it).")
        if isinstance(process_sets, str) and process_sets.lower() == "dynamic":
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
            config.dynamic_process_sets = True
            process_sets = None
        if comm is None:
            base = MPI.COMM_WORLD
        elif isinstance(comm, MPI.Comm):
            base = comm
        elif isinstance(comm, (list, tuple)):
            ranks = sorted(int(r) for r in comm)
            group = MPI.COMM_WORLD.Get_group().Incl(ranks)
            base = MPI.COMM_WORLD.Create(group)  # collective over COMM_WORLD
            group.Free()
            if base == MPI.COMM_NULL:
                raise ValueError(f"Horovod initialization failed: rank "
                                 f"{MPI.COMM_WORLD.Get_rank()} is not in comm={ranks}.")
        else:
            raise ValueError(f"init(comm=...) expects None, a list of ranks or an mpi4py "
                             f"communicator, got {type(comm).__name__}.")
        static: List[List[int]] = []
        for ps in process_sets or ():
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"process_sets must contain ProcessSet objects, got {ps!r}.")
            static.append(ps._resolve_ranks(base))
        engine = Engine(base, config, static)
        engine.start()
        _engine_instance = engine
        global_process_set.ranks = list(range(engine.topology.size))
        global_process_set.process_set_id = 0
        for set_id, ps in enumerate(process_sets or (), start=1):
            ps.process_set_id = set_id
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def shutdown() -> None:
    """A function that shuts Horovod down."""
    global _engine_instance
    with _state_lock:
        engine, _engine_instance = _engine_instance, None
    if engine is not None:
        engine.shutdown()


def is_initialized() -> bool:
    """Returns True if Horovod is initialized."""
    engine = _engine_instance
    return engine is not None and engine.running


def size() -> int:
    """A function that returns the number of Horovod processes."""
    return _topology().size


def rank() -> int:
    """A function that returns the Horovod rank of the calling process."""
    return _topology().rank


def local_size() -> int:
    """A function that returns the number of Horovod processes within the node the current
    process is running on."""
    return _topology().local_size


def local_rank() -> int:
    """A function that returns the local Horovod rank of the calling process, within the
    node that it is running on."""
    return _topology().local_rank


def cross_size() -> int:
    """A function that returns the number of nodes for the local rank of the current
    process."""
    return _topology().cross_size


def cross_rank() -> int:
    """A function that returns the cross Horovod rank of the calling process, across the
    nodes in the job."""
    return _topology().cross_rank


def is_homogeneous() -> bool:
    """Returns True if the cluster is homogeneous (every node runs the same number of ranks)."""
    return _topology().is_homogeneous


def mpi_threads_supported() -> bool:
    """A function that returns a flag indicating whether MPI multi-threading is supported."""
    from mpi4py import MPI
    _engine()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """Returns True if MPI is mode is currently enabled at runtime."""
    return True


def gloo_enabled() -> bool:
    """Returns True if Gloo is mode is currently enabled at runtime."""
    return False


def _build_flag(name: str):
    def flag():
        from aiak_training.common import build_info
        return getattr(build_info, name)()
    flag.__name__ = name
    flag.__doc__ = f"Returns the value of the {name} build flag (see `aiakrun --check-build`)."
    return flag


mpi_built = _build_flag("mpi_built")
gloo_built = _build_flag("gloo_built")
nccl_built = _build_flag("nccl_built")
ddl_built = _build_flag("ddl_built")
ccl_built = _build_flag("ccl_built")
cuda_built = _build_flag("cuda_built")
rocm_built = _build_flag("rocm_built")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Creates a timeline file at `file_path` and begins recording.

    Args:
        file_path: String path to the timeline file.
        mark_cycles: Boolean indicating that cycles should be marked on the timeline.
    """
    engine = _engine()
    if not engine.config.timeline:
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC (or a file path) before hvd.init() "
                         "to use the timeline API.")
    if engine.topology.rank == 0:
        engine.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stops the active timeline recording and closes the file."""
    engine = _engine()
    if engine.topology.rank == 0:
        engine.timeline.stop()


# ---- process sets -------------------------------------------------------------------------
def _control(op_type: OpType, name: str, payload=None):
    engine = _engine()
    req = Request(rank=engine.topology.rank, name=name, op_type=op_type, payload=payload)
    (handle,) = engine.enqueue(0, [req], [TensorEntry(name, 0, (), 0)])
    return engine.wait(handle).result


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Add a new process_set after Horovod initialization and return it.

    Requires running with HOROVOD_DYNAMIC_PROCESS_SETS=1. No process set containing the same
    ranks may exist already. The returned process set will be fully initialized.
    All ranks must call this collectively, in the same order.
    """
    engine = _engine()
    if not engine.config.dynamic_process_sets:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or hvd.init(process_sets='dynamic')) "
                         "to add process sets after initialization.")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    from mpi4py import MPI
    ranks = process_set._resolve_ranks(MPI.COMM_WORLD)
    if process_set.process_set_id is not None or engine.find_process_set(ranks) is not None:
        raise ValueError(f"A process set with ranks {ranks} has already been registered.")
    if not ranks or ranks[0] < 0 or ranks[-1] >= engine.topology.size:
        raise ValueError(f"Process set ranks {ranks} are out of range for size "
                         f"{engine.topology.size}.")
    set_id = _control(OpType.ADD_PROCESS_SET, f"add_process_set.{ranks}", tuple(ranks))
    process_set.process_set_id = set_id
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Attempt to remove process set and return whether this attempt is successful.

    Requires running with HOROVOD_DYNAMIC_PROCESS_SETS=1. All ranks must call this together.
    The global process set cannot be removed.
    """
    engine = _engine()
    if not engine.config.dynamic_process_sets:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to remove process sets.")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or set_id not in engine.process_set_ids():
        return False
    removed = _control(OpType.REMOVE_PROCESS_SET, f"remove_process_set.{set_id}", (set_id,))
    if removed:
        process_set.process_set_id = None
    return bool(removed)
