"""The autotuner attached to a running engine: finds steps, times them, and switches every
rank to the same setting at the same step boundary.

A *step* is one round of the job's allreduces: the first allreduce name of the global set
that is submitted a second time marks the start of every step from then on (with
``DistributedOptimizer`` that is the first gradient of the backward pass), and the step time
is the time between two of its submissions, measured on rank 0.  A sample is
``steps_per_sample`` steps at one setting; its score is the reciprocal of their median step
time, in steps per second (the median keeps one slow step, a checkpoint or a straggler, from
deciding).

Switching: every rank counts the same steps, so all of them end a sample at the same
boundary.  There, on the training thread and before the marker tensor is submitted, rank 0
broadcasts the next setting through the engine (a tensor of five numbers), and every rank
puts it in force as the broadcast returns.  By then each rank has submitted the whole of the
previous step, and the engine executes in negotiated order, so no allreduce is in flight:
the fusion threshold and algorithm change between the same two tensors on every rank.
"""
import statistics
import sys
import time
from typing import List, Optional, Sequence, Set, Tuple

import numpy as np

from aiak_training.allreduce import ALGORITHMS
from aiak_training.common.dtypes import DataType
from aiak_training.common.messages import OpType, Request
from aiak_training.runtime.autotune.csvlog import CsvLog
from aiak_training.runtime.autotune.knobs import Setting, apply_setting
from aiak_training.runtime.autotune.options import AutotuneOptions
from aiak_training.runtime.autotune.search import MARGIN, CoordinateSearch
from aiak_training.runtime.entries import TensorEntry

# Names seen before one repeats: past this, the job's allreduces have no stable names (each
# call auto-named), steps cannot be found, and the tuner stops instead of growing.
MAX_NAMES = 100_000


def say(text: str) -> None:
    print(f"autotune: {text}", file=sys.stdout, flush=True)


class Autotuner:
    def __init__(self, engine, options: AutotuneOptions, start: Setting,
                 axes: Sequence[Tuple[str, Sequence]]):
        self._engine = engine
        self._opts = options
        self._rank = engine.rank_in_set(0)
        self._search = CoordinateSearch(start, axes, options.max_samples) \
            if self._rank == 0 else None
        self._log = CsvLog(options.log_file) if self._rank == 0 else None
        self._seen: Optional[Set[str]] = set()
        self._marker: Optional[str] = None
        self._last = 0.0
        self._times: List[float] = []
        self.steps = 0          # steps completed (the current step's index)
        self._samples = 0       # samples ended, warm-up included
        self._measuring = start

    # ---- called by the engine ------------------------------------------------------------
    def on_allreduce(self, name: str) -> None:
        """An allreduce of the global set is about to be submitted on this rank."""
        if self._marker is None:
            self._find_marker(name)
        elif name == self._marker:
            now = time.monotonic()
            self.steps += 1
            self._times.append(now - self._last)
            self._last = now
            if len(self._times) >= self._opts.steps_per_sample:
                self._end_sample()
                self._last = time.monotonic()  # the switch itself is not part of a step

    def job_ended(self) -> None:
        """The engine shuts down while tuning: rank 0 says how far it got; the setting in
        force stays."""
        if self._rank != 0:
            return
        if self._marker is None:
            self._log.close()
            say("the job ended before tuning started: no step was seen (steps are found by "
                 "an allreduce name that repeats; name the tensors, as DistributedOptimizer "
                 "does).")
            return
        if self._samples < self._opts.warmup_samples:
            where = (f"still warming up ({self._samples} of {self._opts.warmup_samples} "
                     f"warm-up samples of {self._opts.steps_per_sample} steps)")
        else:
            where = (f"{self._search.samples} of about {self._search.planned} samples "
                     f"measured")
            if self._search.samples:
                best = self._search.best
                self._log.row(best, self._search.score(best))
                where += f"; best so far: {best.describe()}"
        self._log.close()
        say(f"the job ended after {self.steps + 1} steps, before tuning finished: "
             f"{where}; the setting in force was {self._measuring.describe()}.")

    # ---- steps and samples ---------------------------------------------------------------
    def _find_marker(self, name: str) -> None:
        if name in self._seen:
            self._marker, self._seen = name, None
            self._last = time.monotonic()
            self.steps = 1
            return
        self._seen.add(name)
        if len(self._seen) > MAX_NAMES:
            self._engine.autotune = None
            if self._rank == 0:
                self._log.close()
                say(f"stopped: none of {MAX_NAMES} allreduce names repeated, so steps cannot "
                     "be found; give the tensors names (DistributedOptimizer does).")

    def _end_sample(self) -> None:
        score = 1.0 / max(statistics.median(self._times), 1e-9)
        self._times = []
        self._samples += 1
        proposal = [0.0, 0.0, 0.0, 0.0, 0.0]
        if self._rank == 0:
            search = self._search
            if self._samples > self._opts.warmup_samples:
                search.record(self._measuring, score)
                self._log.row(self._measuring, score)
            chosen = search.best if search.done else search.next()
            proposal = [float(search.done), float(chosen.fusion_threshold),
                        chosen.cycle_time_ms, float(ALGORITHMS.index(chosen.algorithm)),
                        float(chosen.cache_enabled)]
        done, fusion, cycle, algo, cache = self._agree(proposal)
        setting = Setting(int(fusion), cycle, ALGORITHMS[int(algo)], bool(cache))
        apply_setting(self._engine, setting)
        self._measuring = setting
        if done:
            self._finish(setting)

    def _agree(self, values: List[float]) -> List[float]:
        """Rank 0's ``values`` on every rank: a broadcast through the engine itself, so it is
        ordered with the job's own collectives."""
        buf = np.array(values, dtype=np.float64)
        name = f"aiak.autotune.sample.{self._samples}"
        req = Request(self._rank, name, OpType.BROADCAST, int(DataType.FLOAT64), buf.shape,
                      root=0)
        addr = buf.ctypes.data
        entry = TensorEntry(name, DataType.FLOAT64, buf.shape, addr, addr, keep=buf)
        (handle,) = self._engine.enqueue(0, [req], [entry])
        self._engine.wait(handle)
        return buf.tolist()

    def _finish(self, best: Setting) -> None:
        self._engine.autotune = None
        if self._rank != 0:
            return
        score = self._search.score(best)
        self._log.row(best, score)
        self._log.close()
        where = f"; log: {self._opts.log_file}" if self._opts.log_file else ""
        say(f"chose {best.describe()} ({score:.4g} steps/s; tuning took "
             f"{self.steps} steps, {self._search.samples} samples after "
             f"{self._opts.warmup_samples} warm-up{where})")
        if self._search.kept_start:
            say(f"that is the job's own setting: no setting beats it beyond noise (another "
                f"must score more than {MARGIN:.0%} higher on the mean of its samples and beat "
                f"it again when both are measured at the end)")
        say(f"to run with it without tuning, add to the aiakrun command (without "
            f"--autotune): {best.launcher_flags()}; or set on every rank: {best.environment()}")
