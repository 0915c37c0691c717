"""The actor class every Ray worker runs (Horovod 0.28.1's ``BaseHorovodWorker`` API)."""
from __future__ import annotations

import os
import socket
import sys
from typing import Any, Dict, List, Optional

import cloudpickle
import ray


class BaseHorovodWorker:
    """One rank of a :class:`~aiak_training.ray.RayExecutor` job, living in a Ray actor.

    ``executable`` is the object built by ``start(executable_cls=...)`` (None without one);
    ``execute(fn)`` calls ``fn(executable)`` in this process.  The rank's Horovod environment
    is set by the driver before any user code runs here.
    """

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1):
        self._rank = world_rank
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    # ---- Horovod's worker API -----------------------------------------------------------
    def hostname(self) -> str:
        return socket.gethostname()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def get_gpu_ids(self) -> List[int]:
        """The CUDA devices Ray gave this worker."""
        return list(ray.get_gpu_ids())

    def update_env_vars(self, env_vars: Dict[str, Any]) -> None:
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> Dict[str, str]:
        return dict(os.environ)

    def start_executable(self, executable_cls: Optional[type] = None,
                         executable_args: Optional[list] = None,
                         executable_kwargs: Optional[dict] = None) -> None:
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, func):
        """``func(executable)`` here; an exception carries a note naming this rank."""
        try:
            return func(self.executable)
        except BaseException as exc:
            self._note(exc)
            raise

    # ---- used by the executor -------------------------------------------------------------
    def _aiak_identity(self) -> Dict[str, Any]:
        return dict(node_id=self.node_id(), hostname=self.hostname(), pid=os.getpid(),
                    gpu_ids=self.get_gpu_ids())

    def _aiak_set_rank(self, rank: int, env: Dict[str, str]) -> None:
        self._rank = rank
        self.update_env_vars(env)
        # aiak_training decides at import whether mpi4py may initialize MPI, and this actor
        # imported it before its environment said "Gloo"; a Gloo rank must never start MPI.
        if "mpi4py.MPI" not in sys.modules:
            import mpi4py
            mpi4py.rc.initialize = False
            mpi4py.rc.finalize = False

    # ---- joining an MPI world (aiak_training/ray/mpi_world.py) ------------------------------
    def _aiak_mpi_listen(self, key: bytes) -> tuple:
        """Open the endpoint this rank's hydra placeholder connects to; its (address, port)."""
        from aiak_training.ray.mpi_world import PmiEndpoint
        self._pmi = PmiEndpoint(key)
        return ray.util.get_node_ip_address(), self._pmi.port

    def _aiak_mpi_start_proxy(self, command: List[str]) -> int:
        from aiak_training.ray.mpi_world import start_proxy
        return start_proxy(command)

    def _aiak_mpi_join(self, rank: int, env: Dict[str, str], timeout_s: float) -> None:
        """Take this rank's MPI identity from its placeholder: the first ``hvd.init()`` here
        then joins the job's MPI world."""
        if "mpi4py.MPI" in sys.modules:
            raise RuntimeError(
                "aiak_training.ray: MPI was already initialized in this actor (something "
                "imported mpi4py.MPI before the worker joined the job's MPI world), so it "
                f"cannot become rank {rank}. Set AIAK_RAY_TRANSPORT=gloo, or import MPI only "
                "inside the function the executor runs.")
        identity = self._pmi.accept(timeout_s)
        self._rank = rank
        self.update_env_vars({**env, **identity})

    def _aiak_elastic_run(self, env: Dict[str, str], executable_payload: bytes,
                          payload: bytes):
        """Be one elastic worker: ``("ok", fn(executable))``, or ``("exit", code)`` when the
        driver sends this worker away (its node left the job, or the job ended without it).
        Its rank changes from world to world, so the notes name the worker id instead."""
        self._aiak_set_rank(env.get("AIAK_ELASTIC_WORKER_ID", "?"), env)
        # aiak_training may have been imported before the environment made this process an
        # elastic worker; its world must come from the driver from the first hvd.init() on.
        from aiak_training.elastic.worker import install_world_source
        install_world_source()
        self._aiak_start_executable(executable_payload)
        try:
            return "ok", self._aiak_execute(payload)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            return "exit", code

    def _aiak_start_executable(self, payload: bytes) -> None:
        try:
            self.start_executable(*cloudpickle.loads(payload))
        except BaseException as exc:
            self._note(exc)
            raise

    def _aiak_execute(self, payload: bytes):
        """Run a pickled ``fn(executable)`` (pickled on the driver, where errors are clearer)."""
        return self.execute(cloudpickle.loads(payload))

    def _note(self, exc: BaseException) -> None:
        # The note travels inside Ray's error text (the remote traceback), so the driver's
        # exception names the rank without changing the user's exception type.
        # An elastic worker's rank changes from world to world: it is named by its id.
        who = f"rank {self._rank}" if isinstance(self._rank, int) else \
            f"elastic worker {self._rank}"
        if hasattr(exc, "add_note"):
            exc.add_note(f"aiak_training.ray: raised on {who} "
                         f"(host {self.hostname()}, pid {os.getpid()})")
