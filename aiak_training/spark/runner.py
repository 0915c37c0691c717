"""``aiak_training.spark.run``: one aiak_training job inside a Spark job (Horovod's API).

``run`` starts ``num_proc`` Spark tasks in barrier execution mode, so Spark schedules all of
them together or none.  The tasks tell each other their hosts (``BarrierTaskContext``), number
the ranks so that tasks on one host are contiguous, and each starts one Python process for
its rank with the Horovod environment set.  Spark tasks are not started by an MPI launcher, so
the ranks use aiak_training's Gloo mode, meeting at a rendezvous store in the driver.

The driver also runs a small control server: tasks report there that they started, forward
their rank's output line by line (``[rank]<stdout>:...``, as Horovod does) and report a
failure with the rank's traceback, which fails the run at once.
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, TextIO

import cloudpickle

from aiak_training.runner.modes import scheduler_jobs

# Horovod's default for start_timeout when HOROVOD_SPARK_START_TIMEOUT is unset.
DEFAULT_START_TIMEOUT_S = 600
_PR_SET_PDEATHSIG = 1


class SparkRankError(RuntimeError):
    """A rank of ``run`` failed; ``rank`` names it and ``remote_traceback`` is its traceback
    (None when the rank's process was killed)."""

    def __init__(self, message: str, rank: int, remote_traceback: Optional[str] = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


# ---- driver side: the control server ------------------------------------------------------
class RankControl:
    """Collects the tasks' reports: started ranks, output lines, the first failure."""

    def __init__(self, num_proc: int, stdout: TextIO, stderr: TextIO, timestamps: bool):
        self.token = secrets.token_hex(16)
        self.num_proc = num_proc
        self.started: Dict[int, float] = {}
        self.failure: Optional[Dict[str, Any]] = None
        self.changed = threading.Condition()
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._timestamps = timestamps
        self._write_lock = threading.Lock()
        control = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                first = self.rfile.readline()
                try:
                    if json.loads(first).get("token") != control.token:
                        return
                except ValueError:
                    return
                try:
                    for raw in self.rfile:
                        try:
                            control._on_message(json.loads(raw), self)
                        except ValueError:
                            continue
                except OSError:
                    pass
                finally:
                    control._on_closed(self)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("0.0.0.0", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="aiak-spark-control")
        self._thread.start()

    def _on_closed(self, conn) -> None:
        """A task's connection ended (the elastic form watches its tasks this way)."""

    def _on_message(self, msg: Dict[str, Any], conn=None) -> None:
        kind = msg.get("kind")
        if kind == "line":
            stream = self._streams.get(msg.get("stream"), self._streams["stdout"])
            stamp = time.strftime("%a %b %d %H:%M:%S %Y") if self._timestamps else ""
            with self._write_lock:
                stream.write(f"{stamp}[{msg['rank']}]<{msg['stream']}>:{msg['text']}\n")
                stream.flush()
            return
        with self.changed:
            if kind == "started":
                self.started[int(msg["rank"])] = float(msg["time"])
            elif kind == "failed" and self.failure is None:
                self.failure = msg
            self.changed.notify_all()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ---- task side ----------------------------------------------------------------------------
class Reporter:
    """A task's connection to the driver's control server (JSON lines)."""

    def __init__(self, addr: str, port: int, token: str, timeout: float):
        self._sock = socket.create_connection((addr, port), timeout=timeout)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self.send(token=token)

    def send(self, **msg) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self._lock:
            self._sock.sendall(data)

    def orders(self):
        """Lines the driver sends back on this connection (the elastic form's orders)."""
        return self._sock.makefile("rb")

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def _die_with_parent_hook():
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls it

    def hook() -> None:
        # The rank must not outlive its Spark task (cancelled or killed by Spark).
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def _pump(stream, reporter: Reporter, rank: int, name: str) -> None:
    for raw in iter(stream.readline, b""):
        try:
            reporter.send(kind="line", rank=rank, stream=name,
                          text=raw.decode("utf-8", "replace").rstrip("\n"))
        except OSError:
            pass  # the driver is gone; keep draining so the rank never blocks on a full pipe
    stream.close()


def start_rank_process(job: Dict[str, Any], payload_path: str, result_path: str,
                       env: Dict[str, str], reporter: Reporter, label) -> tuple:
    """Start one rank's fresh Python (``scheduler_child``) with its output forwarded under
    ``label``; returns the process and the threads pumping its output."""
    proc = subprocess.Popen(
        [job["executable"] or sys.executable, "-m", "aiak_training.runner.modes.scheduler_child",
         payload_path, result_path],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent_hook())
    pumps = [threading.Thread(target=_pump, args=(s, reporter, label, n), daemon=True)
             for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for t in pumps:
        t.start()
    return proc, pumps


def finish_rank_process(proc, pumps, result_path: str) -> tuple:
    """Wait for the rank's process; ``(exit code, the pickled outcome or None)``."""
    code = proc.wait()
    for t in pumps:
        t.join(timeout=5)
    outcome = None
    if os.path.exists(result_path):
        with open(result_path, "rb") as f:
            outcome = f.read()
    return code, outcome


def _rank_task(job: Dict[str, Any]):
    """The barrier task: agree on ranks, run this rank's process, report, yield its result."""
    def task(_partition):
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        partition = ctx.partitionId()
        host = socket.gethostname()
        hosts = [json.loads(m)["host"] for m in ctx.allGather(json.dumps({"host": host}))]
        order = scheduler_jobs.contiguous_order(hosts)
        rank = order.index(partition)
        env = dict(os.environ)
        env.update(job["env"] or {})
        env.update(scheduler_jobs.rank_envs([hosts[p] for p in order], job["addr"],
                                         job["store_port"],
                                         timeout_s=job["gloo_timeout"], nics=job["nics"])[rank])
        # The rank imports what this task can import (pyspark's zip, --py-files, ...).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["PYTHONUNBUFFERED"] = "1"
        reporter = Reporter(job["addr"], job["control_port"], job["token"], job["timeout"])
        workdir = tempfile.mkdtemp(prefix=f"aiak-spark-rank{rank}-")
        payload_path = os.path.join(workdir, "payload.pkl")
        result_path = os.path.join(workdir, "result.pkl")
        try:
            with open(payload_path, "wb") as f:
                f.write(job["payload"])
            reporter.send(kind="started", rank=rank, time=time.time())
            code, outcome = finish_rank_process(
                *start_rank_process(job, payload_path, result_path, env, reporter, rank),
                result_path)
            if code == 0 and outcome is not None:
                status = cloudpickle.loads(outcome)
                yield rank, cloudpickle.dumps(status[1])
                return
            if outcome is not None:
                _, type_name, text = cloudpickle.loads(outcome)
                what = f"raised {type_name}"
            else:
                what = (f"exited with signal {signal.Signals(-code).name}" if code < 0
                        else f"exited with code {code}")
                text = None
            message = (f"aiak_training.spark: rank {rank} (host {host}, partition {partition}) "
                       f"{what}" + (f":\n{text}" if text else ""))
            reporter.send(kind="failed", rank=rank, host=host, partition=partition,
                          what=what, traceback=text)
            raise RuntimeError(message)
        finally:
            reporter.close()
            for path in (payload_path, result_path):
                if os.path.exists(path):
                    os.unlink(path)
            os.rmdir(workdir)
    return task


# ---- the API ------------------------------------------------------------------------------
def _start_timeout(start_timeout: Optional[float]) -> float:
    if start_timeout is None:
        raw = os.environ.get("HOROVOD_SPARK_START_TIMEOUT", "").strip()
        try:
            start_timeout = float(raw) if raw else DEFAULT_START_TIMEOUT_S
        except ValueError:
            raise ValueError(f"HOROVOD_SPARK_START_TIMEOUT={raw!r}: expected seconds.") from None
    if start_timeout <= 0:
        raise ValueError(f"start_timeout={start_timeout!r}: must be > 0 seconds.")
    return float(start_timeout)


def active_context():
    """The active SparkContext, or Horovod's error (its wording, so that existing checks on
    it keep working)."""
    import pyspark  # the package's __init__ already checked that it is installed
    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise Exception("Could not find an active SparkContext, are you running in a "
                        "PySpark session?")
    return sc


def prepare(sc, api: str, fn, args, kwargs, num_proc, start_timeout) -> tuple:
    """Check what ``run``/``run_elastic`` were given; ``(num_proc, start timeout, payload)``
    with the function and its arguments pickled before any task starts."""
    if not callable(fn):
        raise TypeError(f"aiak_training.spark.{api}: fn must be callable, got {fn!r}")
    if num_proc is None:
        num_proc = sc.defaultParallelism
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"aiak_training.spark.{api}(num_proc={num_proc!r}): must be a "
                         "positive integer.")
    timeout = _start_timeout(start_timeout)
    scheduler_jobs.pickled(fn, "function")
    payload = scheduler_jobs.pickled((fn, tuple(args or ()), dict(kwargs or {})),
                                  "the args/kwargs of function",
                                  name=getattr(fn, "__qualname__", repr(fn)))
    return num_proc, timeout, payload


def run(fn, args=(), kwargs={}, num_proc=None, start_timeout=None, use_mpi=None,
        use_gloo=None, extra_mpi_args=None, env=None, stdout=None, stderr=None, verbose=1,
        nics=None, prefix_output_with_timestamp=False, executable=None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` as ``num_proc`` aiak_training ranks in Spark tasks.

    Returns the ranks' return values in rank order.  ``num_proc`` defaults to the
    SparkContext's ``defaultParallelism``; ``start_timeout`` (default
    ``$HOROVOD_SPARK_START_TIMEOUT``, else 600 s) bounds the wait for all tasks to start.
    ``env`` adds variables to the ranks' environment (the tasks' own is inherited);
    ``stdout``/``stderr`` receive the ranks' output (default: this process's).  The ranks use
    the Gloo mode: ``use_mpi=True`` and ``use_gloo=False`` are errors.
    """
    sc = active_context()
    if use_mpi:
        raise ValueError("aiak_training.spark.run(use_mpi=True): Spark tasks cannot form an "
                         "MPI world here; aiak_training.spark runs its ranks over Gloo only "
                         "(leave use_mpi unset or pass use_gloo=True).")
    if use_gloo is False:
        raise ValueError("aiak_training.spark.run(use_gloo=False): Gloo is the only "
                         "transport aiak_training.spark supports.")
    if extra_mpi_args:
        warnings.warn("aiak_training.spark.run: extra_mpi_args is ignored (the ranks run over "
                      "Gloo, not MPI)", stacklevel=2)
    num_proc, timeout, payload = prepare(sc, "run", fn, args, kwargs, num_proc, start_timeout)

    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    driver_host = sc.getConf().get("spark.driver.host") or socket.gethostname()
    store, store_port = scheduler_jobs.start_store()
    control = RankControl(num_proc, stdout, stderr, prefix_output_with_timestamp)
    group = f"aiak-spark-{control.token[:12]}"
    job = dict(payload=payload, addr=driver_host, store_port=store_port,
               control_port=control.port,
               token=control.token, timeout=timeout, gloo_timeout=None,
               nics=sorted(nics) if nics else None, env={k: str(v) for k, v in (env or {}).items()},
               executable=executable)
    outcome: Dict[str, Any] = {}

    def spark_job():
        try:
            sc.setJobGroup(group, f"aiak_training.spark.run: {num_proc} rank(s) of "
                                  f"{getattr(fn, '__name__', 'fn')}", interruptOnCancel=True)
            rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(
                _rank_task(job))
            outcome["results"] = rdd.collect()
        except BaseException as exc:  # reported by the waiting thread below
            outcome["error"] = exc
        finally:
            with control.changed:
                outcome["done"] = True
                control.changed.notify_all()

    if verbose >= 2:
        print(f"aiak_training.spark: starting {num_proc} rank(s), rendezvous at "
              f"{driver_host}:{store_port}", file=stderr)
    t0 = time.monotonic()
    runner = threading.Thread(target=spark_job, daemon=True, name="aiak-spark-job")
    runner.start()
    try:
        with control.changed:
            while True:
                if control.failure is not None or outcome.get("done"):
                    break
                if len(control.started) < num_proc and time.monotonic() - t0 > timeout:
                    break
                control.changed.wait(timeout=0.5)
            if outcome.get("error") is not None and control.failure is None:
                # The failed task reports before it raises; give its message time to arrive.
                control.changed.wait_for(lambda: control.failure is not None, timeout=3.0)
        failure, started = control.failure, dict(control.started)
        if failure is None and not outcome.get("done"):
            sc.cancelJobGroup(group)
            runner.join(timeout=30)
            raise TimeoutError(
                f"aiak_training.spark.run: only {len(started)} of num_proc={num_proc} rank(s) "
                f"started within start_timeout={timeout:g} s; the SparkContext's "
                f"defaultParallelism (task slots) is {sc.defaultParallelism}. Barrier mode "
                f"needs all {num_proc} tasks running at once: ask for fewer or add executors.")
        if failure is not None:
            sc.cancelJobGroup(group)
            runner.join(timeout=30)
            text = failure.get("traceback")
            raise SparkRankError(
                f"aiak_training.spark.run: rank {failure['rank']} (host {failure['host']}, "
                f"partition {failure['partition']}) {failure['what']}"
                + (f":\n{text}" if text else ""), rank=int(failure["rank"]),
                remote_traceback=text)
        runner.join()
        if "error" in outcome:
            raise RuntimeError(f"aiak_training.spark.run: the Spark job failed: "
                               f"{short_error(outcome['error'])}") from outcome["error"]
        by_rank = dict(outcome["results"])
        return [cloudpickle.loads(by_rank[r]) for r in range(num_proc)]
    except BaseException:
        if not outcome.get("done"):  # Ctrl-C or an error here: stop the ranks too
            sc.cancelJobGroup(group)
        raise
    finally:
        control.close()
        del store  # stops the rendezvous store


def short_error(exc: BaseException) -> str:
    """The first line of ``exc``'s text that names an exception or error (at most 500
    characters), for one-line reports of a failed Spark job."""
    text = str(exc)
    for line in text.splitlines():
        if "Exception" in line or "Error" in line:
            return line.strip()[:500]
    return text.strip().splitlines()[0][:500] if text.strip() else type(exc).__name__
