"""``aiakrun --advise [--what-if ...] <job flags> python train.py``: the launcher side.

Two bounded runs of the job, each an ordinary aiakrun launch with the same flags (hosts,
transport, ``--virtual-hosts``...), then a table printed by aiakrun:

1. the link measurement (:mod:`aiak_training.advisor.link_measure`) in place of the script;
2. the script itself, profiled by :mod:`aiak_training.advisor.trace` (through a
   ``sitecustomize`` on ``PYTHONPATH``), which stops it after a few steps.  Not with
   ``--what-if ...,profile=PATH``: the profile file stands for the script, which is not run.

``AIAK_ADVISE_PROFILE_OUT=path`` writes the measured profile (the slowest rank's) as a
profile file (:mod:`aiak_training.advisor.whatif`), to be reused with ``profile=path``;
``AIAK_ADVISE_DEVICE`` names the device in it.

Each run has ``AIAK_ADVISE_BUDGET_S`` seconds (default 120); past that its processes are
stopped and aiakrun says why.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import aiak_training.advisor as advisor_pkg
from aiak_training.advisor import trace
from aiak_training.advisor.model import Cluster, Profile, default_config, predict_table
from aiak_training.advisor.report import (apply_what_if, cluster_from_measurement,
                                          cluster_sources, format_table, profile_from_ranks,
                                          recommend)
from aiak_training.advisor.whatif import target_profile, write_profile

BUDGET_ENV = "AIAK_ADVISE_BUDGET_S"
#: When set, the predictions are also written there as JSON (for benchmarks and tools).
JSON_ENV = "AIAK_ADVISE_JSON"
#: When set, the measured profile is written there as a profile file (``profile=`` reads it).
PROFILE_OUT_ENV = "AIAK_ADVISE_PROFILE_OUT"
#: The device named in that file (default: this machine's processor).
DEVICE_ENV = "AIAK_ADVISE_DEVICE"
DEFAULT_BUDGET_S = 120.0
_GRACE_S = 10.0


class AdviseError(RuntimeError):
    """The advisor had to stop; the message says why."""


def job_flags(argv: Sequence[str], command: Sequence[str]) -> List[str]:
    """aiakrun's own arguments of ``argv`` (the part before ``command``), without the
    advisor's ``--advise`` and ``--what-if``."""
    head = list(argv[:len(argv) - len(command)])
    if head and head[-1] == "--":
        head.pop()
    out: List[str] = []
    skip = False
    for token in head:
        if skip:
            skip = False
        elif token == "--advise" or token.startswith("--what-if="):
            pass
        elif token == "--what-if":
            skip = True
        else:
            out.append(token)
    return out


def _budget() -> float:
    text = os.environ.get(BUDGET_ENV, "")
    try:
        value = float(text) if text else DEFAULT_BUDGET_S
    except ValueError:
        raise AdviseError(f"{BUDGET_ENV} must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise AdviseError(f"{BUDGET_ENV} must be > 0, got {text!r}")
    return value


def _launch(flags: Sequence[str], command: Sequence[str], env: Dict[str, str],
            budget: float) -> Tuple[Optional[int], str]:
    """Run one aiakrun job in its own session; ``(exit code or None on timeout, output)``."""
    argv = [sys.executable, "-m", "aiak_training.runner.launch", *flags, "--", *command]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=budget)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        # aiakrun stops its ranks on SIGTERM; the whole session goes if it does not.
        for sig, wait in ((signal.SIGTERM, _GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, _ = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            out, _ = proc.communicate()
        return None, out or ""


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _measure_links(flags: Sequence[str], work: str, budget: float) -> Dict[str, Any]:
    out_path = os.path.join(work, "links.json")
    code, out = _launch(flags, [sys.executable, "-m", "aiak_training.advisor.link_measure", out_path],
                        dict(os.environ), budget)
    if code is None:
        raise AdviseError(f"the link measurement ran past its budget of {budget:g} s "
                          f"({BUDGET_ENV}); its output:\n{_tail(out)}")
    if code != 0 or not os.path.exists(out_path):
        raise AdviseError(f"the link measurement failed (exit code {code}):\n{_tail(out)}")
    with open(out_path, encoding="utf-8") as f:
        return json.load(f)


def _profile_script(flags: Sequence[str], command: Sequence[str], work: str,
                    budget: float) -> List[Dict[str, Any]]:
    site = os.path.join(os.path.dirname(advisor_pkg.__file__), "_site")
    env = dict(os.environ)
    env[trace.DIR_ENV] = work
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    steps = int(env.get(trace.WARMUP_ENV, 2)) + int(env.get(trace.STEPS_ENV, 5))
    code, out = _launch(flags, command, env, budget)
    docs = []
    for path in sorted(glob.glob(os.path.join(work, "rank*.json"))):
        with open(path, encoding="utf-8") as f:
            docs.append(json.load(f))
    ok = [d for d in docs if d.get("status") == "ok"]
    if ok:
        return ok
    if code is None:
        raise AdviseError(f"the script ran past the advisor's budget of {budget:g} s "
                          f"({BUDGET_ENV}) before {steps} optimizer steps; stopped. Its "
                          f"output:\n{_tail(out)}")
    if docs:
        got = max(d.get("steps", 0) for d in docs)
        raise AdviseError(f"the script ended after {got} optimizer step(s); the advisor "
                          f"needs {steps} (AIAK_ADVISE_WARMUP + AIAK_ADVISE_STEPS). Its "
                          f"output:\n{_tail(out)}")
    raise AdviseError("the script never called the optimizer: no hvd.DistributedOptimizer "
                      "was created and stepped, so there are no gradients to measure "
                      f"(exit code {code}). Its output:\n{_tail(out)}")


def run_advise(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
    """Measure, predict, print the table; the exit status of aiakrun."""
    if not args.advise:
        print("aiakrun: error: --what-if needs --advise", file=sys.stderr)
        return 2
    if not args.command:
        print("aiakrun: error: --advise needs the job's command "
              "(e.g. aiakrun --advise -np 2 python train.py)", file=sys.stderr)
        return 2
    from aiak_training.runner.modes.elastic.launch import elastic_requested
    if elastic_requested(args):
        print("aiakrun: error: --advise measures a fixed set of ranks; drop the elastic flags "
              "(--min-np, --host-discovery-script...)", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = job_flags(argv, args.command)
    start = time.monotonic()
    what_if = args.what_if
    run_script = what_if is None or what_if.needs_script
    docs: List[Dict[str, Any]] = []
    try:
        budget = _budget()
        with tempfile.TemporaryDirectory(prefix="aiakadvise.") as work:
            print("aiakrun --advise: measuring the links...", file=sys.stderr, flush=True)
            measured = _measure_links(flags, work, budget)
            if run_script:
                print("aiakrun --advise: profiling the script...", file=sys.stderr, flush=True)
                docs = _profile_script(flags, args.command, work, budget)
            else:
                print(f"aiakrun --advise: profile {what_if.profile} given: the script is not "
                      "run", file=sys.stderr, flush=True)
    except AdviseError as exc:
        print(f"aiakrun: error: --advise: {exc}", file=sys.stderr)
        return 1
    cluster = cluster_from_measurement(measured)
    measured_profile = profile_from_ranks(docs) if docs else None
    optimizer = docs[0].get("optimizer", "") if docs else ""
    if measured_profile is not None and os.environ.get(PROFILE_OUT_ENV):
        device = _device_name(docs)
        write_profile(os.environ[PROFILE_OUT_ENV], measured_profile, device, optimizer,
                      source=f"aiakrun --advise, {len(docs)} rank(s), slowest rank's median "
                             f"of the timed steps")
        print(f"aiakrun --advise: profile written to {os.environ[PROFILE_OUT_ENV]} "
              f"(device: {device})", file=sys.stderr)
    elif os.environ.get(PROFILE_OUT_ENV):
        print(f"aiakrun --advise: {PROFILE_OUT_ENV} ignored: the script was not profiled",
              file=sys.stderr)
    sources: List[str] = []
    if what_if is not None:
        measured_net = bool(measured.get("links"))
        cluster = apply_what_if(cluster, what_if, measured_net=measured_net)
        profile, sources = target_profile(what_if, measured_profile)
        sources = cluster_sources(what_if, measured_net) + sources
        if what_if.profile_file is not None:
            optimizer = what_if.profile_file.optimizer
    else:
        assert measured_profile is not None
        profile = measured_profile
    print(format_table(profile, cluster, what_if=what_if,
                       links=() if what_if else measured.get("links") or (),
                       optimizer=optimizer, sources=sources))
    took = time.monotonic() - start
    print(f"(measured in {took:.1f} s)")
    if os.environ.get(JSON_ENV):
        _write_json(os.environ[JSON_ENV], profile, cluster, took)
    return 0


def _device_name(docs: Sequence[Dict[str, Any]]) -> str:
    """The device a profile was measured on: ``AIAK_ADVISE_DEVICE``, else what the ranks
    recorded, else this machine's processor."""
    if os.environ.get(DEVICE_ENV):
        return os.environ[DEVICE_ENV]
    for doc in docs:
        if doc.get("device"):
            return str(doc["device"])
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import platform
    return f"CPU: {model or platform.processor() or platform.machine()} " \
           f"({os.cpu_count()} cores), host {platform.node()}"


def _write_json(path: str, profile: Profile, cluster: Cluster, took: float) -> None:
    rows = predict_table(profile, cluster)
    default = default_config(cluster)
    best, _ = recommend(rows, default)
    doc = {"seconds": took, "nodes": cluster.nodes, "ranks_per_node": cluster.ranks_per_node,
           "net": {"bw": cluster.net.bw, "lat": cluster.net.lat}, "op_s": cluster.op_s,
           "recommended": best.name, "default": default.name,
           # The model's inputs, so that a changed model can be re-checked on these data.
           "profile": {"grads": profile.grads, "call_s": profile.call_s,
                       "update_s": profile.update_s, "fused_update_s": profile.fused_update_s,
                       "numels": profile.grad_numels},
           "cluster": {"intra": [cluster.intra.bw, cluster.intra.lat],
                       "copy_bw": cluster.copy_bw, "gloo": cluster.gloo},
           "rows": [{"name": cfg.name, "flags": cfg.flags, "step_s": t, "speedup": sp,
                     "lossless": not cfg.dgc} for cfg, t, sp in rows]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
