"""aiak-training: a Horovod-compatible distributed-training library.

Use it as ``import aiak_training.torch as hvd`` in place of ``import horovod.torch as hvd``.
"""
__version__ = "0.1.0"
HOROVOD_API_VERSION = "0.28.1"


def _request_mpi_thread_level() -> None:
    """``HOROVOD_MPI_THREADS_DISABLE=1``: ask MPI for less than MPI_THREAD_MULTIPLE.

    mpi4py initializes MPI on the first import of ``mpi4py.MPI``, so the level is set here,
    before any module of this package imports it.  Once ``init()`` has returned, only the
    engine's thread calls MPI, so MPI_THREAD_SERIALIZED is the least that is correct (Horovod
    asks for MPI_THREAD_SINGLE, which a background thread does not strictly allow).  If
    ``mpi4py.MPI`` was imported first, ``init()`` warns that the variable had no effect.
    """
    import sys
    from aiak_training.common.env import env_bool  # imports no MPI
    if not env_bool("HOROVOD_MPI_THREADS_DISABLE") or "mpi4py.MPI" in sys.modules:
        return
    import mpi4py
    mpi4py.rc.thread_level = "serialized"


def _defer_mpi_init_for_gloo() -> None:
    """A Gloo job (``aiakrun --gloo``, ``HOROVOD_CONTROLLER=gloo``) runs without MPI: keep
    mpi4py from initializing MPI when a module of this package imports ``mpi4py.MPI`` (its
    buffers and constants still serve as the engine's vocabulary)."""
    import os
    import sys
    controller = os.environ.get("HOROVOD_CONTROLLER", "").strip().lower()
    if "mpi4py.MPI" in sys.modules or controller == "mpi":
        return
    if controller == "gloo" or os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "").strip():
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False


def _note_arrival_before_mpi_init() -> None:
    """Under aiakrun, tell it that this rank is about to enter ``MPI_Init`` (which the first
    import of ``mpi4py.MPI`` by this package runs), so that a rank that never gets there ends
    the job after ``HOROVOD_START_TIMEOUT`` instead of leaving the others waiting.  A Gloo
    job notes its arrival at the rendezvous instead (runtime/transport/gloo.py)."""
    import os
    import sys
    if not os.environ.get("AIAK_NOTE_ARRIVAL") or "mpi4py.MPI" in sys.modules:
        return
    import mpi4py
    if mpi4py.rc.initialize:  # MPI mode: MPI_Init is where the ranks meet
        from aiak_training.common.job.exit_guard import note_arrival
        note_arrival("MPI_Init")


_request_mpi_thread_level()
_defer_mpi_init_for_gloo()
_note_arrival_before_mpi_init()
