"""The elastic form of :class:`~aiak_training.ray.RayExecutor` (``min_workers``/``max_workers``).

The hosts of the job are the live Ray nodes, each offering as many slots as its CPUs (and
GPUs) hold workers.  aiakrun's elastic driver decides which slots run, numbers the ranks,
blacklists nodes whose workers died and enforces ``reset_limit``/``elastic_timeout``; here a
slot's worker is a fresh Ray actor pinned to its node, running the user's function as an
elastic worker.  When a node disappears its actors die, which the driver treats like a lost
host; when one appears, discovery offers its slots and the job grows to them.
"""
from __future__ import annotations

import signal
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from aiak_training.ray.worker import BaseHorovodWorker
from aiak_training.runner.modes import scheduler_jobs
from aiak_training.runner.modes.elastic.driver import ElasticSettings
from aiak_training.runner.modes.elastic.function_job import (FunctionWorker, run_function_job,
                                                             worker_env)
from aiak_training.runner.modes.elastic.hosts import Slot


# What the driver's messages call the settings, in RayExecutor's words.
NAMES = {"--min-np": "min_workers", "-np": "min_workers", "--max-np": "max_workers",
         "--elastic-timeout": "elastic_timeout", "--reset-limit": "reset_limit",
         "--start-timeout": "timeout_s"}


def check_elastic_arguments(min_workers: int, max_workers: Optional[int],
                            reset_limit: Optional[int], cooldown_range,
                            elastic_timeout: float) -> Optional[Tuple[float, float]]:
    """Validate the elastic keyword arguments; returns the cool-down range as floats."""
    if not isinstance(min_workers, int) or min_workers < 1:
        raise ValueError(f"RayExecutor(min_workers={min_workers!r}): must be a positive "
                         "integer.")
    if max_workers is not None and (not isinstance(max_workers, int)
                                    or max_workers < min_workers):
        raise ValueError(f"RayExecutor(max_workers={max_workers!r}): must be an integer >= "
                         f"min_workers ({min_workers}).")
    if reset_limit is not None and (not isinstance(reset_limit, int) or reset_limit < 0):
        raise ValueError(f"RayExecutor(reset_limit={reset_limit!r}): must be an integer >= 0.")
    if elastic_timeout is None or elastic_timeout <= 0:
        raise ValueError(f"RayExecutor(elastic_timeout={elastic_timeout!r}): must be > 0 "
                         "seconds.")
    if cooldown_range is None:
        return None
    try:
        low, high = (float(v) for v in cooldown_range)
    except (TypeError, ValueError):
        raise ValueError(f"RayExecutor(cooldown_range={cooldown_range!r}): expected two "
                         "numbers (minimum, maximum seconds).") from None
    if low < 0 or high < low:
        raise ValueError(f"RayExecutor(cooldown_range={cooldown_range!r}): needs "
                         "0 <= minimum <= maximum.")
    return low, high


class _ActorWorker(FunctionWorker):
    """One elastic worker: an actor and its single long call.  Its 'exit code' is 0 when the
    function returned, the code it left with when the driver sent it away, 1 when it raised
    and -SIGKILL when the actor died (its node was lost)."""

    def __init__(self, actor: Any, ref: Any, wid: str, node: str):
        super().__init__()
        self.actor, self.ref, self.wid, self.node = actor, ref, wid, node

    def _check(self) -> Optional[int]:
        ready, _ = ray.wait([self.ref], timeout=0)
        if not ready:
            return None
        try:
            kind, value = ray.get(self.ref)
        except ray.exceptions.RayActorError as exc:
            self.error = exc
            return -signal.SIGKILL
        except Exception as exc:  # the user's exception, with the worker's traceback
            self.error = exc
            return 1
        if kind == "exit":
            return int(value)
        self._value = value
        return 0

    def signal(self, signum: int) -> None:
        # An actor cannot be asked to stop gracefully mid-call: every stop is a kill.
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass


class ElasticRayJob:
    """What an elastic ``RayExecutor`` needs between ``start()`` and ``shutdown()``."""

    def __init__(self, executor: Any, min_workers: int, max_workers: Optional[int],
                 reset_limit: Optional[int], cooldown: Optional[Tuple[float, float]],
                 elastic_timeout: float, override_discovery: bool,
                 kill: Callable[[List[Any], List[str]], None], error_cls: type):
        # ``kill`` and ``error_cls`` come from the executor's module (no import cycle).
        self.ex = executor
        self._kill, self._error_cls = kill, error_cls
        self.settings = ElasticSettings(
            num_proc=None, min_np=min_workers, max_np=max_workers,
            elastic_timeout=float(elastic_timeout), reset_limit=reset_limit, cooldown=cooldown,
            poll=0.05, stop_grace=5.0, log_prefix="aiak_training.ray", names=NAMES)
        self.override_discovery = override_discovery
        self.actors: List[Any] = []
        self._payload: bytes = b""
        self._env: Dict[str, str] = {}
        self._store = None
        self._port = 0
        self._addr = ""

    def start(self, executable_payload: bytes, extra_env_vars: Dict[str, Any]) -> None:
        if not self.override_discovery:
            discovery = getattr(self.ex.settings, "discovery", None)
            if discovery is None or not hasattr(discovery, "find_available_hosts_and_slots"):
                raise ValueError("RayExecutor(override_discovery=False) needs settings."
                                 "discovery, an object with find_available_hosts_and_slots() "
                                 "returning {node_id: slots}.")
        self._payload = executable_payload
        self.settings.start_timeout = float(self.ex._setting("timeout_s", 30))
        self._store, self._port = scheduler_jobs.start_store()
        self._addr = ray.util.get_node_ip_address()
        env = {str(k): str(v) for k, v in extra_env_vars.items()}
        env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(self.ex._setting("timeout_s", 30)))
        nics = self.ex._setting("nics", None)
        for name, value in scheduler_jobs.nic_env(sorted(nics) if nics else None).items():
            env.setdefault(name, value)  # the user's extra_env_vars win
        self._env = env

    def discover(self) -> Dict[str, int]:
        """{node id: workers it can hold} over the live nodes."""
        if not self.override_discovery:
            return dict(self.ex.settings.discovery.find_available_hosts_and_slots())
        found: Dict[str, int] = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            counts = []
            if self.ex.cpus_per_worker:
                counts.append(int(resources.get("CPU", 0) // self.ex.cpus_per_worker))
            if self.ex.gpus_per_worker:
                counts.append(int(resources.get("GPU", 0) // self.ex.gpus_per_worker))
            slots = min(counts) if counts else (self.settings.max_np or 1)
            if slots > 0:
                found[node["NodeID"]] = slots
        return found

    def run(self, payload: bytes) -> List[Any]:
        actor_cls = ray.remote(BaseHorovodWorker)

        def spawn(wid: str, slot: Slot) -> _ActorWorker:
            node = slot[0]
            actor = actor_cls.options(
                num_cpus=self.ex.cpus_per_worker, num_gpus=self.ex.gpus_per_worker,
                max_restarts=0, max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            self.actors.append(actor)
            env = dict(self._env)
            env.update(worker_env(self.settings, self._port, wid, node, self._addr))
            return _ActorWorker(actor, actor._aiak_elastic_run.remote(env, self._payload,
                                                                      payload), wid, node)

        try:
            return run_function_job(self.settings, self.discover, spawn, self._store,
                                    log=sys.stderr, error_cls=self._error_cls)
        finally:
            self._kill_actors()

    def _kill_actors(self) -> None:
        # Workers that finished are idle actors still holding their CPUs: end them too.
        actors, self.actors = self.actors, []
        self._kill(actors, [f"elastic worker actor {i}" for i in range(len(actors))])

    @staticmethod
    def unsupported(what: str) -> NotImplementedError:
        return NotImplementedError(
            f"RayExecutor.{what} is not available in the elastic form (min_workers=...): "
            "the workers change from world to world; use run() or execute().")

    def shutdown(self) -> None:
        self._kill_actors()
        self._store = None


__all__: List[str] = ["ElasticRayJob", "check_elastic_arguments"]
