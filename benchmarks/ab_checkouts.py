"""Run one benchmark alternately on two checkouts of this repository, in the same session.

"No worse than before" targets (issue 33: the MPI path, elastic recovery) compare this
working tree with an earlier commit measured in the same run.  The earlier commit is exported
and built elsewhere (``git archive <commit> | tar -x -C /tmp/base``, then ``python setup.py
build_ext --inplace`` there); this script then runs the benchmark command in each checkout in
turn (``cwd`` and ``PYTHONPATH`` set to it, so ``import aiak_training`` resolves there),
``--rounds`` times, baseline first, and compares each timed result and each ratio the
benchmark reports::

    python benchmarks/ab_checkouts.py --baseline /tmp/base --rounds 3 --json out.json -- \\
        mpiexec -n 2 python3 benchmarks/allreduce_bench.py --no-gloo --json {json}

``{json}`` in the command is replaced by a file for that run; the benchmark must write
``bench_common.report``'s JSON there.  Reported for each timed result (in seconds) and each
ratio: both sides' medians over the rounds and every value; for a time, before / after above
1 means this tree is faster.
"""
import argparse
import json
import os
import statistics
import tempfile
from typing import Dict, List

from bench_common import run_json_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(checkout: str, command: List[str], out_dir: str, tag: str) -> Dict:
    path = os.path.join(out_dir, f"{tag}.json")
    cmd = [part.replace("{json}", path) for part in command]
    env = dict(os.environ, PYTHONPATH=checkout)
    return run_json_job([cmd], path, f"{tag}: the benchmark", env=env, cwd=checkout)


def paired(values: Dict[str, Dict[str, List[float]]]) -> Dict[str, Dict]:
    """Per name measured on both sides: each side's median over the rounds and the values."""
    return {name: {"before": statistics.median(values["before"][name]),
                   "after": statistics.median(after),
                   "before_values": values["before"][name], "after_values": after}
            for name, after in values["after"].items() if name in values["before"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the earlier checkout, built in place")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="PATH", help="write the comparison as JSON")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the benchmark command after --, with {json} for its output file")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not any("{json}" in part for part in command):
        raise SystemExit("give the benchmark command after --, with {json} where its --json "
                         "file goes")
    sides = {"before": os.path.abspath(args.baseline), "after": REPO}
    medians: Dict[str, Dict[str, List[float]]] = {"before": {}, "after": {}}
    ratios: Dict[str, Dict[str, List[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory() as out_dir:
        for round_no in range(args.rounds):
            for side, checkout in sides.items():
                data = run_once(checkout, command, out_dir, f"{side}{round_no}")
                for r in data.get("results", []):  # a launcher's merged file has ratios only
                    medians[side].setdefault(r["name"], []).append(r["median_s"])
                for name, value in data["ratios"].items():
                    ratios[side].setdefault(name, []).append(value)
                print(f"round {round_no} {side}: " + ", ".join(
                    f"{k}={v:.3f}" for k, v in data["ratios"].items()), flush=True)
    comparison = {"command": command, "rounds": args.rounds, "baseline": sides["before"],
                  "results": paired(medians), "ratios": paired(ratios)}
    for name, r in comparison["results"].items():
        print(f"{name:<44} before {r['before'] * 1e3:9.3f} ms  after {r['after'] * 1e3:9.3f} ms"
              f"  before/after {r['before'] / r['after']:.3f}")
    for name, r in comparison["ratios"].items():
        print(f"ratio {name}: before {r['before']:.3f}, after {r['after']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(comparison, f, indent=2)


if __name__ == "__main__":
    main()
