"""``aiak_training.spark.run_elastic``: an elastic job whose workers run in Spark tasks.

``max_np`` ordinary (not barrier) Spark tasks are started; each registers at the driver's
control server and offers one slot.  aiakrun's elastic driver, fed with those slots, decides
which of them run a worker, numbers the ranks, and re-forms the world when a worker is lost;
a task starts a worker (a fresh Python running the function as an elastic worker) when the
driver asks.  Each task is its own "host" for the driver: a failed worker blacklists its task
only, not every task of the machine (in local mode all tasks share one machine).  Tasks are
not barrier tasks because a barrier stage fails as a whole when one task fails.

A task that ends (its connection to the driver closes) loses its worker; what Spark then does
with the task (retry it, or fail the Spark job) is Spark's: see docs/spark.md.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from typing import Any, Dict, List, Optional, Set

import cloudpickle

from aiak_training.elastic import protocol
from aiak_training.runner.modes import scheduler_jobs
from aiak_training.runner.modes.elastic.driver import ElasticSettings
from aiak_training.runner.modes.elastic.function_job import (ElasticJobError, FunctionWorker,
                                                             run_function_job, worker_env)
from aiak_training.runner.modes.elastic.hosts import Slot
from aiak_training.spark.runner import (RankControl, Reporter, SparkRankError, active_context,
                                        finish_rank_process, prepare, short_error,
                                        start_rank_process)

# What the driver's messages call the settings, in run_elastic's words.
NAMES = {"-np": "num_proc", "--min-np": "min_np", "--max-np": "max_np",
         "--elastic-timeout": "elastic_timeout", "--reset-limit": "reset_limit",
         "--start-timeout": "start_timeout"}


class _ElasticControl(RankControl):
    """The control server of an elastic run: besides output lines it keeps one connection
    per task (its slot; closed means lost), sends the tasks orders on it, and collects the
    workers' exits and results."""

    def __init__(self, stdout, stderr, timestamps: bool):
        super().__init__(0, stdout, stderr, timestamps)
        self.tasks: Dict[str, Any] = {}
        self.lost: Set[str] = set()
        self.exits: Dict[str, tuple] = {}
        self._order_lock = threading.Lock()

    def _on_message(self, msg: Dict[str, Any], conn=None) -> None:
        kind = msg.get("kind")
        if kind == "register":
            with self.changed:
                conn.aiak_task = str(msg["key"])
                self.tasks[conn.aiak_task] = conn
                self.changed.notify_all()
        elif kind == "exit":
            outcome = msg.get("outcome")
            with self.changed:
                self.exits[str(msg["wid"])] = (int(msg["code"]),
                                               base64.b64decode(outcome) if outcome else None)
        else:
            super()._on_message(msg, conn)

    def _on_closed(self, conn) -> None:
        key = getattr(conn, "aiak_task", None)
        if key is not None:
            with self.changed:
                self.lost.add(key)
                self.changed.notify_all()

    def live(self) -> List[str]:
        with self.changed:
            return [k for k in self.tasks if k not in self.lost]

    def order(self, key: str, **msg) -> bool:
        """Send ``msg`` to task ``key``; False when it is gone."""
        conn = self.tasks.get(key)
        if conn is None or key in self.lost:
            return False
        try:
            with self._order_lock:
                conn.wfile.write((json.dumps(msg) + "\n").encode())
            return True
        except OSError:
            return False


class _TaskWorker(FunctionWorker):
    """A worker started by task ``key``: its exit code arrives as a message, or the task's
    connection closes (the task, and the worker with it, is gone)."""

    def __init__(self, control: _ElasticControl, key: str, wid: str):
        super().__init__()
        self.control, self.key, self.wid = control, key, wid

    def _check(self) -> Optional[int]:
        with self.control.changed:
            ended = self.control.exits.get(self.wid)
            lost = self.key in self.control.lost
        if ended is None:
            if lost:
                self.error = RuntimeError(f"aiak_training.spark: the Spark task {self.key} "
                                          f"of worker {self.wid} ended")
                return 1
            return None
        code, outcome = ended
        status = cloudpickle.loads(outcome) if outcome is not None else None
        if status is not None and status[0] == "ok":
            self._value = status[1]
        elif status is not None and code != 0 and status[1] != "SystemExit":
            # (SystemExit: the driver sent the worker away; not a failure of the job)
            self.error = SparkRankError(f"aiak_training.spark: worker {self.wid} (task "
                                        f"{self.key}) raised {status[1]}:\n{status[2]}",
                                        rank=-1, remote_traceback=status[2])
        return code

    def signal(self, signum: int) -> None:
        self.control.order(self.key, kind="signal", wid=self.wid, signum=int(signum))


def _slot_task(job: Dict[str, Any]):
    """The Spark task: register a slot, then start and signal workers as the driver orders
    until it says the job is done (or goes away)."""
    def task(_partition):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        host = socket.gethostname()
        key = f"{host}-task{ctx.partitionId()}" + \
            (f"-attempt{ctx.attemptNumber()}" if ctx.attemptNumber() else "")
        reporter = Reporter(job["addr"], job["control_port"], job["token"], job["timeout"])
        workdir = tempfile.mkdtemp(prefix=f"aiak-spark-elastic-{ctx.partitionId()}-")
        payload_path = os.path.join(workdir, "payload.pkl")
        procs: Dict[str, Any] = {}

        def watch(wid: str, proc, pumps, result_path: str) -> None:
            code, outcome = finish_rank_process(proc, pumps, result_path)
            try:
                reporter.send(kind="exit", wid=wid, code=code,
                              outcome=base64.b64encode(outcome).decode() if outcome else None)
            except OSError:
                pass  # the driver is gone

        try:
            with open(payload_path, "wb") as f:
                f.write(job["payload"])
            reporter.send(kind="register", key=key)
            # Orders come on the same connection; it closes when the driver ends.
            for raw in reporter.orders():
                msg = json.loads(raw)
                if msg["kind"] == "done":
                    break
                wid = msg["wid"]
                if msg["kind"] == "spawn":
                    env = dict(os.environ)
                    env.update(job["env"])
                    env.update(msg["env"])
                    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
                    result_path = os.path.join(workdir, f"{wid}.result")
                    proc, pumps = start_rank_process(job, payload_path, result_path, env,
                                                      reporter, wid)
                    procs[wid] = proc
                    threading.Thread(target=watch, args=(wid, proc, pumps, result_path),
                                     daemon=True).start()
                elif msg["kind"] == "signal" and wid in procs and procs[wid].poll() is None:
                    procs[wid].send_signal(int(msg["signum"]))
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
            reporter.close()
            shutil.rmtree(workdir, ignore_errors=True)
        return iter([])
    return task


def _count(name: str, value, minimum: int) -> Optional[int]:
    if value is not None and (not isinstance(value, int) or value < minimum):
        raise ValueError(f"aiak_training.spark.run_elastic({name}={value!r}): must be an "
                         f"integer >= {minimum}.")
    return value


def run_elastic(fn, args=(), kwargs={}, num_proc=None, min_np=None, max_np=None,
                start_timeout=None, elastic_timeout=None, reset_limit=None, env=None,
                stdout=None, stderr=None, verbose=1, nics=None,
                prefix_output_with_timestamp=False) -> List[Any]:
    """Run the elastic training function ``fn(*args, **kwargs)`` in Spark tasks.

    Starts ``max_np`` tasks (default ``num_proc``, which defaults to the SparkContext's
    ``defaultParallelism``); the first world waits for ``num_proc`` of them within
    ``start_timeout``.  A worker that dies is left out and the others continue from their
    last commit while at least ``min_np`` (default ``num_proc``) remain; fewer for
    ``elastic_timeout`` seconds (default ``$HOROVOD_ELASTIC_TIMEOUT``, else 600), or more
    than ``reset_limit`` resets, fail the run with :class:`ElasticJobError`.  Returns the
    return values of the last world's ranks, in rank order.
    """
    sc = active_context()
    num_proc, timeout, payload = prepare(sc, "run_elastic", fn, args, kwargs, num_proc,
                                         start_timeout)
    min_np = num_proc if _count("min_np", min_np, 1) is None else min_np
    max_np = num_proc if _count("max_np", max_np, 1) is None else max_np
    if not min_np <= num_proc <= max_np:
        raise ValueError(f"aiak_training.spark.run_elastic: needs min_np <= num_proc <= "
                         f"max_np, got {min_np}, {num_proc}, {max_np}.")
    _count("reset_limit", reset_limit, 0)
    if elastic_timeout is None:
        raw = os.environ.get(protocol.WAIT_ENV, "").strip()
        elastic_timeout = float(raw) if raw else protocol.DEFAULT_ELASTIC_TIMEOUT
    if elastic_timeout <= 0:
        raise ValueError(f"aiak_training.spark.run_elastic(elastic_timeout="
                         f"{elastic_timeout!r}): must be > 0 seconds.")
    settings = ElasticSettings(num_proc=num_proc, min_np=min_np, max_np=max_np,
                               elastic_timeout=float(elastic_timeout), reset_limit=reset_limit,
                               start_timeout=timeout, poll=0.05, stop_grace=5.0,
                               log_prefix="aiak_training.spark", names=NAMES)
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    driver_host = sc.getConf().get("spark.driver.host") or socket.gethostname()
    store, store_port = scheduler_jobs.start_store()
    control = _ElasticControl(stdout, stderr, prefix_output_with_timestamp)
    group = f"aiak-spark-elastic-{control.token[:12]}"
    job = dict(payload=payload, addr=driver_host, control_port=control.port,
               token=control.token, timeout=timeout, executable=None,
               env={k: str(v) for k, v in (env or {}).items()})
    extra = scheduler_jobs.nic_env(sorted(nics) if nics else None)
    outcome: Dict[str, Any] = {}

    def spark_job() -> None:
        try:
            sc.setJobGroup(group, f"aiak_training.spark.run_elastic: up to {max_np} task(s)",
                           interruptOnCancel=True)
            sc.parallelize(range(max_np), max_np).mapPartitions(_slot_task(job)).collect()
        except BaseException as exc:  # reported when the job has ended
            outcome["error"] = exc

    def spark_job_ended() -> Optional[str]:
        # Its tasks are gone and no new one can come: waiting for slots would be in vain.
        if runner.is_alive():
            return None
        return "the Spark job ended" + (f" ({short_error(outcome['error'])})"
                                        if "error" in outcome else "") + \
            "; no Spark task is left to run a worker"

    def discover() -> Dict[str, int]:
        return {key: 1 for key in control.live()}

    def spawn(wid: str, slot: Slot) -> _TaskWorker:
        env_ = dict(extra)
        env_.update(worker_env(settings, store_port, wid, slot[0], driver_host))
        control.order(slot[0], kind="spawn", wid=wid, env=env_)
        return _TaskWorker(control, slot[0], wid)

    if verbose >= 2:
        print(f"aiak_training.spark: starting up to {max_np} task(s), rendezvous at "
              f"{driver_host}:{store_port}", file=stderr)
    runner = threading.Thread(target=spark_job, daemon=True, name="aiak-spark-elastic-job")
    runner.start()
    try:
        with control.changed:
            if not control.changed.wait_for(lambda: len(control.tasks) >= num_proc
                                            or not runner.is_alive(), timeout=timeout) \
                    or len(control.tasks) < num_proc:
                raise TimeoutError(
                    f"aiak_training.spark.run_elastic: only {len(control.tasks)} of num_proc="
                    f"{num_proc} task(s) started within start_timeout={timeout:g} s; the "
                    f"SparkContext's defaultParallelism (task slots) is "
                    f"{sc.defaultParallelism}"
                    + (f"; the Spark job failed: {short_error(outcome['error'])}"
                       if "error" in outcome else ""))
        return run_function_job(settings, discover, spawn, store, log=stderr,
                                error_cls=ElasticJobError, abort=spark_job_ended)
    finally:
        for key in control.live():
            control.order(key, kind="done")
        runner.join(timeout=30)
        if runner.is_alive():
            sc.cancelJobGroup(group)
            runner.join(timeout=30)
        control.close()
        del store  # stops the rendezvous store


__all__ = ["run_elastic", "ElasticJobError"]
