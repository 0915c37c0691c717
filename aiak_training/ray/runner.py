"""``RayExecutor``: aiak_training jobs whose ranks are Ray actors (Horovod 0.28.1's API).

The driver reserves the workers' resources with a placement group, starts one actor per rank
in it, numbers the ranks from where Ray put the actors (ranks on one node are contiguous, so
local/cross ranks and hierarchical allreduce follow the real layout) and hands every actor its
Horovod environment.  The ranks are the actors themselves, so the user's function runs in
them with Ray's APIs at hand.  Where MPICH is installed the actors join one MPI world
(``ray/mpi_world.py``: hydra started by hand, the engine over MPI and every MPI feature);
otherwise, or with ``AIAK_RAY_TRANSPORT=gloo``, they form Gloo worlds over a rendezvous store
in the driver.  The elastic form (``min_workers``) always uses Gloo: its worlds change size.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional

import ray
import ray.exceptions
from ray.util.placement_group import (get_current_placement_group, placement_group,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from aiak_training.common.job.ranks import place_ranks
from aiak_training.ray.mpi_world import HydraWorld, new_key, ray_transport
from aiak_training.ray.worker import BaseHorovodWorker
from aiak_training.runner.modes import scheduler_jobs

log = logging.getLogger("aiak_training.ray")

# How long shutdown() waits for Ray to confirm that the killed actors are gone.
_SHUTDOWN_WAIT_S = 15.0


@dataclasses.dataclass
class MiniSettings:
    """The settings ``RayExecutor.create_settings`` returns (Horovod's field names).

    ``timeout_s`` bounds worker start-up and the Gloo rendezvous, and is each collective's
    timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``) unless the job's environment sets one;
    ``placement_group_timeout_s`` bounds the wait for the cluster to have room for the
    workers.  ``ssh_*`` are accepted for compatibility: the workers talk over TCP, not ssh.
    """
    nics: Optional[set] = None
    verbose: int = 1
    key: Optional[str] = None
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100
    elastic: bool = False


class RayWorkerError(RuntimeError):
    """A worker actor died (or could not start); ``rank`` names it."""

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


@dataclasses.dataclass
class _Worker:
    actor: Any
    rank: int
    node_id: str
    hostname: str
    pid: int

    def where(self) -> str:
        return f"rank {self.rank} (host {self.hostname}, node {self.node_id[:12]}, pid {self.pid})"


class RayExecutor:
    """Run a function on ``num_workers`` Ray actors that form one aiak_training job.

    Use ``num_workers`` to pack workers onto as few nodes as have room, or ``num_hosts`` and
    ``num_workers_per_host`` for exactly that many workers on each of that many distinct
    nodes.  Both together are accepted when ``num_workers`` splits evenly over ``num_hosts``
    (Horovod 0.28.1 rejects that combination).  Inside an existing placement group (e.g. a Ray
    Tune trial) the workers use it unless ``use_current_placement_group=False``.

    With ``min_workers`` (and optionally ``max_workers``) the job is elastic: the workers are
    placed on the live Ray nodes, the job continues from its last commit when a node is lost
    (while ``min_workers`` remain) and grows onto nodes that join (see
    :mod:`aiak_training.ray.elastic`).  The function must be an elastic training function
    (``hvd.elastic.run``).
    """

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: int = 100,
                        nics: Optional[set] = None) -> MiniSettings:
        """Settings for :class:`RayExecutor`.  ``ssh_str`` (a private key's text) is written
        to ``ssh_identity_file`` with mode 0600 if that file does not exist yet."""
        if ssh_str:
            if not ssh_identity_file:
                raise ValueError("create_settings(ssh_str=...) needs ssh_identity_file, the "
                                 "path to write the key to.")
            if not os.path.exists(ssh_identity_file):
                fd = os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(ssh_str)
        if timeout_s is None or timeout_s <= 0:
            raise ValueError(f"create_settings(timeout_s={timeout_s!r}): must be > 0 seconds.")
        if placement_group_timeout_s is None or placement_group_timeout_s <= 0:
            raise ValueError(f"create_settings(placement_group_timeout_s="
                             f"{placement_group_timeout_s!r}): must be > 0 seconds.")
        return MiniSettings(ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[int] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range: Optional[List[int]] = None,
                 elastic_timeout: int = 600, override_discovery: bool = True):
        # Horovod 0.28.1's argument checks, then ours.
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("`max_workers` provided without any positive `min_workers`. "
                             "Elastic workloads require a positive `min_workers`")
        if min_workers and num_workers:
            raise ValueError("Both `min_workers` and `num_workers` provided. Only one of the "
                             "above is allowed as workloads cannot be elastic and non-elastic.")
        self._elastic = None
        if min_workers is not None:
            from aiak_training.ray.elastic import check_elastic_arguments
            cooldown = check_elastic_arguments(min_workers, max_workers, reset_limit,
                                               cooldown_range, elastic_timeout)
            if num_hosts is not None:
                raise ValueError("RayExecutor(min_workers=..., num_hosts=...): an elastic job "
                                 "places its workers on whatever nodes are alive; leave "
                                 "num_hosts unset.")
        if gpus_per_worker and not use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False. use_gpu must be "
                             "True if gpus_per_worker is set.")
        if use_gpu and gpus_per_worker is not None and gpus_per_worker < 1:
            raise ValueError(f"gpus_per_worker must be >= 1: Got {gpus_per_worker}.")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor({name}={value!r}): must be a positive integer.")
        if not isinstance(num_workers_per_host, int) or num_workers_per_host < 1:
            raise ValueError(f"RayExecutor(num_workers_per_host={num_workers_per_host!r}): "
                             "must be a positive integer.")
        if cpus_per_worker is None or cpus_per_worker < 0:
            raise ValueError(f"RayExecutor(cpus_per_worker={cpus_per_worker!r}): must be >= 0.")
        if num_workers is not None and num_hosts is not None:
            if num_workers % num_hosts or num_workers_per_host not in (1, num_workers // num_hosts):
                raise ValueError(
                    f"RayExecutor(num_workers={num_workers}, num_hosts={num_hosts}, "
                    f"num_workers_per_host={num_workers_per_host}): num_workers must be "
                    f"num_hosts x num_workers_per_host; give num_workers or num_hosts alone.")
            num_workers_per_host = num_workers // num_hosts
            num_workers = None  # placed as num_hosts x num_workers_per_host
        self.settings = settings
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self._workers: List[_Worker] = []
        self._pg = None
        self._own_pg = False
        self._store = None
        self._hydra: Optional[HydraWorld] = None
        self.transport: Optional[str] = None  # "mpi" or "gloo", decided by start()
        self._started = False
        try:
            settings.elastic = min_workers is not None
        except AttributeError:
            pass
        if min_workers is not None:
            from aiak_training.ray.elastic import ElasticRayJob
            self._elastic = ElasticRayJob(self, min_workers, max_workers, reset_limit,
                                          cooldown, elastic_timeout, override_discovery,
                                          kill=kill_actors, error_cls=RayWorkerError)

    # ---- public API ---------------------------------------------------------------------
    @property
    def workers(self) -> List[Any]:
        """The worker actors, in rank order."""
        return [w.actor for w in self._workers]

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None) -> None:
        """Place and start the workers, give each its rank's environment, then build
        ``executable_cls(*executable_args, **executable_kwargs)`` in every worker."""
        if self._started:
            raise RuntimeError("RayExecutor.start() was already called; call shutdown() first.")
        # Everything that must travel is checked before any actor exists.
        payload = scheduler_jobs.pickled(
            (executable_cls, list(executable_args or []), dict(executable_kwargs or {})),
            "executable_cls/executable_args/executable_kwargs")
        if executable_cls is not None:
            scheduler_jobs.pickled(executable_cls, "executable_cls")
        if not ray.is_initialized():
            ray.init()  # as Horovod: a local cluster when none is running
        if self._elastic is not None:
            # Elastic workers are started per world by the driver inside run()/execute().
            self._elastic.start(payload, extra_env_vars or {})
            self._started = True
            return
        try:
            self._place_workers()
            self.transport, mpiexec = ray_transport()
            self._setup_environment(extra_env_vars or {}, mpiexec)
            self._gather([w.actor._aiak_start_executable.remote(payload) for w in self._workers],
                         "starting executable_cls")
            self._started = True
        except BaseException:
            self.shutdown()
            raise

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(executable)`` on every worker; the results in rank order.

        ``callbacks`` are accepted for Horovod compatibility and, as in Horovod 0.28.1's
        non-elastic executor, not called.
        """
        self._check_callbacks(callbacks)
        payload = scheduler_jobs.pickled(fn, "function")
        if self._elastic is not None:
            self._require_started()
            return self._elastic.run(payload)
        return self._gather(self._submit(payload), "execute")

    def run(self, fn: Callable[..., Any], args: Optional[List] = None,
            kwargs: Optional[Dict] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order (in the
        elastic form: of the last world's ranks)."""
        self._check_callbacks(callbacks)
        payload = self._call_payload(fn, args, kwargs)
        if self._elastic is not None:
            self._require_started()
            return self._elastic.run(payload)
        return self._gather(self._submit(payload), "run")

    def run_remote(self, fn: Callable[..., Any], args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List[Any]:
        """As :meth:`run`, but returns the workers' ObjectRefs (rank order) at once."""
        if self._elastic is not None:
            raise self._elastic.unsupported("run_remote()")
        return self._submit(self._call_payload(fn, args, kwargs))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the rank 0 worker only; its result."""
        if self._elastic is not None:
            raise self._elastic.unsupported("execute_single()")
        self._require_started()
        payload = scheduler_jobs.pickled(fn, "function")
        return self._gather([self._workers[0].actor._aiak_execute.remote(payload)],
                            "execute_single")[0]

    def shutdown(self) -> None:
        """Kill every worker actor, release the placement group and stop the rendezvous
        store.  Returns once Ray reports the actors dead (at most about 15 s)."""
        if self._hydra is not None:
            # First: mpiexec then ends its proxies and placeholders, and says nothing about
            # the actors going next.  The actors' MPI is idle; they are killed below.
            self._hydra.stop()
            self._hydra = None
        workers, self._workers = self._workers, []
        kill_actors([w.actor for w in workers], [w.where() for w in workers])
        if self._elastic is not None:
            self._elastic.shutdown()
        if self._pg is not None and self._own_pg:
            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
        self._pg, self._own_pg = None, False
        self._store = None  # dropping the server object stops the store
        self._started = False

    # ---- placement ----------------------------------------------------------------------
    def _setting(self, name: str, default):
        value = getattr(self.settings, name, None)
        return default if value is None else value

    def _bundle(self, workers: int) -> Dict[str, float]:
        bundle = {"CPU": self.cpus_per_worker * workers}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker * workers
        return {k: v for k, v in bundle.items() if v}

    def _place_workers(self) -> None:
        current = get_current_placement_group() if self.use_current_placement_group else None
        if self.num_workers is None and self.num_hosts is None and current is None:
            raise ValueError("RayExecutor needs num_workers, or num_hosts (with "
                             "num_workers_per_host), or to run inside a placement group.")
        if current is not None:
            log.info("aiak_training.ray: using the current placement group "
                     "(use_current_placement_group=False to create a new one)")
            count = self.num_workers or self.num_hosts * self.num_workers_per_host
            self._pg, self._own_pg = current, False
            slots = [-1] * count
        elif self.num_workers is not None:
            count = self.num_workers
            self._create_pg([self._bundle(1)] * count, "PACK",
                            f"{count} worker(s) x {self._bundle(1)} packed")
            slots = list(range(count))
        else:
            per = self.num_workers_per_host
            count = self.num_hosts * per
            self._create_pg([self._bundle(per)] * self.num_hosts, "STRICT_SPREAD",
                            f"{self.num_hosts} distinct node(s) x {per} worker(s), "
                            f"{self._bundle(per)} per node")
            slots = [i // per for i in range(count)]
        actor_cls = ray.remote(BaseHorovodWorker)
        actors = []
        for index, bundle_index in enumerate(slots):
            options: Dict[str, Any] = dict(num_cpus=self.cpus_per_worker,
                                           num_gpus=self.gpus_per_worker,
                                           max_restarts=0, max_task_retries=0)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=bundle_index,
                placement_group_capture_child_tasks=False)
            actors.append(actor_cls.options(**options).remote(world_rank=index,
                                                              world_size=count))
        # Keep the handles now, so that a failure below still kills them in shutdown().
        self._workers = [_Worker(a, i, "?", "?", -1) for i, a in enumerate(actors)]
        timeout_s = float(self._setting("timeout_s", 30))
        refs = [a._aiak_identity.remote() for a in actors]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = sorted(refs.index(r) for r in pending)
            raise TimeoutError(f"RayExecutor: worker(s) {late} of {count} did not start within "
                               f"timeout_s={timeout_s:g} s of their placement.")
        identities = self._gather(refs, "starting the workers", workers=self._workers)
        # Ranks of one node become contiguous (the order Ray gave is kept otherwise).
        order = scheduler_jobs.contiguous_order([i["node_id"] for i in identities])
        self._workers = [_Worker(actors[i], rank, identities[i]["node_id"],
                                 identities[i]["hostname"], identities[i]["pid"])
                         for rank, i in enumerate(order)]
        self._gpu_ids = [identities[i]["gpu_ids"] for i in order]

    def _create_pg(self, bundles: List[Dict[str, float]], strategy: str, asked: str) -> None:
        pg = placement_group(bundles, strategy=strategy)
        self._pg, self._own_pg = pg, True
        timeout_s = float(self._setting("placement_group_timeout_s", 100))
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            raise TimeoutError(
                f"RayExecutor: the cluster did not have room for {asked} "
                f"({len(bundles)} bundle(s), {strategy}) within placement_group_timeout_s="
                f"{timeout_s:g} s. The cluster has {len(nodes)} alive node(s); resources now "
                f"available: {_fmt(ray.available_resources())}, in total: "
                f"{_fmt(ray.cluster_resources())}. Ask for fewer workers, fewer CPUs/GPUs per "
                f"worker, or add nodes.")

    def _setup_environment(self, extra_env_vars: Dict[str, Any],
                           mpiexec: Optional[str]) -> None:
        """Give every worker its rank's environment and, with ``mpiexec`` (MPICH's), make
        the workers one MPI world; without it they form Gloo worlds at ``hvd.init()``."""
        # On one node every worker sees all of that node's GPUs of the job (as Horovod does),
        # so that CUDA IPC works between them and local_rank picks the device.
        gpu_env: Dict[str, str] = {}
        if self.use_gpu:
            by_node: Dict[str, List[int]] = {}
            for w, ids in zip(self._workers, self._gpu_ids):
                by_node.setdefault(w.node_id, []).extend(ids)
            gpu_env = {w.node_id: ",".join(str(i) for i in by_node[w.node_id])
                       for w in self._workers}
        addr, port = "", 0
        if mpiexec is None:
            self._store, port = scheduler_jobs.start_store()
            addr = ray.util.get_node_ip_address()
        nics = self._setting("nics", None)
        bound = "HOROVOD_GLOO_TIMEOUT_SECONDS" if mpiexec is None \
            else "AIAK_COLLECTIVE_TIMEOUT_SECONDS"
        timeout = None if bound in extra_env_vars else self._setting("timeout_s", 30)
        envs = scheduler_jobs.rank_envs([w.node_id for w in self._workers], addr, port,
                                     timeout_s=timeout, nics=sorted(nics) if nics else None,
                                     extra=extra_env_vars,
                                     transport="gloo" if mpiexec is None else "mpi")
        for w, env in zip(self._workers, envs):
            if w.node_id in gpu_env:
                env.setdefault("CUDA_VISIBLE_DEVICES", gpu_env[w.node_id])
        if mpiexec is not None:
            self._join_mpi_world(mpiexec, envs)
            return
        self._gather([w.actor._aiak_set_rank.remote(w.rank, env)
                      for w, env in zip(self._workers, envs)], "setting up the workers")

    def _join_mpi_world(self, mpiexec: str, envs: List[Dict[str, str]]) -> None:
        """Start hydra by hand: each node's first worker runs its node's proxy, and every
        worker takes its rank's MPI identity from its placeholder (ray/mpi_world.py)."""
        timeout_s = float(self._setting("timeout_s", 30))
        key = new_key()
        addrs = self._gather([w.actor._aiak_mpi_listen.remote(key) for w in self._workers],
                             "opening the MPI rendezvous")
        # One hydra proxy per node, started by the node's local rank 0 (ranks of one node are
        # contiguous, see _place_workers, as hydra numbers them).
        placement = place_ranks([w.node_id for w in self._workers])
        leaders = [w for w, r in zip(self._workers, placement) if r.local_rank == 0]
        sizes = [r.local_size for r in placement if r.local_rank == 0]
        self._hydra = HydraWorld(mpiexec, sizes, {w.rank: tuple(a) for w, a in
                                                  zip(self._workers, addrs)},
                                 key, ray.util.get_node_ip_address(), timeout_s)
        commands = self._hydra.start()
        self._gather([w.actor._aiak_mpi_start_proxy.remote(cmd)
                      for w, cmd in zip(leaders, commands)], "starting hydra's proxies",
                     workers=leaders)
        self._gather([w.actor._aiak_mpi_join.remote(w.rank, env, timeout_s)
                      for w, env in zip(self._workers, envs)], "joining the MPI world")

    # ---- calls --------------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("RayExecutor: call start() before running functions "
                               "(or the executor was shut down).")

    @staticmethod
    def _check_callbacks(callbacks) -> None:
        for cb in callbacks or ():
            if not callable(cb):
                raise TypeError(f"callbacks must be callables, got {cb!r}")

    @staticmethod
    def _call_payload(fn, args, kwargs) -> bytes:
        if not callable(fn):
            raise TypeError(f"RayExecutor: fn must be callable, got {fn!r}")
        scheduler_jobs.pickled(fn, "function")
        args, kwargs = list(args or []), dict(kwargs or {})
        scheduler_jobs.pickled((args, kwargs), "the args/kwargs of function",
                            name=getattr(fn, "__qualname__", repr(fn)))
        return scheduler_jobs.pickled(lambda _executable: fn(*args, **kwargs), "function")

    def _submit(self, payload: bytes) -> List[Any]:
        self._require_started()
        return [w.actor._aiak_execute.remote(payload) for w in self._workers]

    def _gather(self, refs: List[Any], what: str,
                workers: Optional[List[_Worker]] = None) -> List[Any]:
        """Results in the order of ``refs`` (rank order).  The first failure is raised at
        once: the other ranks may be blocked in a collective with the failed one, and they
        fail on their own within the collective timeout."""
        workers = self._workers if workers is None else workers
        index = {ref: i for i, ref in enumerate(refs)}
        results: List[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            # A bounded wait keeps Ctrl-C responsive while a long run is going.
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise RayWorkerError(
                        f"aiak_training.ray: {workers[i].where()} died during {what}: "
                        f"{_first_line(exc)}", rank=workers[i].rank) from exc
        return results


def kill_actors(actors: List[Any], names: List[str]) -> None:
    """``ray.kill`` every actor; return once Ray reports them dead (at most about 15 s)."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
    deadline = time.monotonic() + _SHUTDOWN_WAIT_S
    for actor, name in zip(actors, names):
        # A call to a killed actor fails once Ray has marked it dead.
        try:
            ray.get(actor._aiak_identity.remote(),
                    timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            pass
        except ray.exceptions.GetTimeoutError:
            log.warning("aiak_training.ray: %s was not reported dead within %.0f s of "
                        "shutdown()", name, _SHUTDOWN_WAIT_S)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:1] + [line for line in lines if "exit detail" in line.lower()][:1])


def _fmt(resources: Dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if k in ("CPU", "GPU") or k.startswith("TPU")}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) or "none"
