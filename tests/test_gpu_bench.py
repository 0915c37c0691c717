"""benchmarks/gpu_bench.py runs where there is no GPU: with --smoke-cpu its three benchmarks
take CPU tensors and small sizes, so the script itself (timing, checks, the JSON and its
ratio keys) is exercised by CI and a lent GPU's minutes are not spent finding its typos.
Its figures mean nothing here; the GPU figures come from benchmarks/gpu_check.sh."""
import json
import sys

import pytest

from launch import run_ranks

SMOKE = ["--smoke-cpu", "--reps", "5", "--warmup", "1", "--inner", "1"]

RATIOS = {
    "grouped": {"gpu_grouped_vs_torch_buckets_1rank"},
    "step": {"gpu_step_overhead", "gpu_step_overhead_vs_ddp_ms", "gpu_step_overhead_hvd_ms",
             "gpu_step_overhead_ddp_ms"},
    "staged": {"gpu_staged_2ranks_vs_floor"},
}


@pytest.mark.parametrize("bench, ranks", [("grouped", 1), ("step", 1), ("staged", 2)])
def test_gpu_bench_smoke_on_cpu(tmp_path, bench, ranks):
    out = tmp_path / f"{bench}.json"
    proc = run_ranks([ranks], [sys.executable, "benchmarks/gpu_bench.py", "--bench", bench,
                               "--json", str(out)] + SMOKE, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    data = json.loads(out.read_text())
    assert set(data["ratios"]) == RATIOS[bench]
    assert all(v == v for v in data["ratios"].values())  # no NaN
    assert data["machine"]["gpu"].startswith("none (--smoke-cpu")
    assert data["machine"]["ranks"] == ranks
    assert all(r["reps"] == 5 and r["min_s"] <= r["median_s"] <= r["max_s"]
               for r in data["results"])
    if bench == "staged":  # both results were compared with the expected sums, twice
        assert all(r["params"]["checked_tensors"] == 2 * r["params"]["tensors"]
                   for r in data["results"]), data["results"]
    if bench == "step":  # the hooks that DistributedOptimizer leaves out at one rank
        hvd_row = next(r for r in data["results"] if r["name"] == "hvd_distributed_optimizer")
        assert hvd_row["params"]["hooks_registered_by_benchmark"]


def test_gpu_bench_needs_a_gpu_without_smoke_cpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_ranks([1], [sys.executable, "benchmarks/gpu_bench.py", "--bench", "grouped"])
    assert proc.returncode == 1
    assert "needs a CUDA device" in proc.stdout and "--smoke-cpu" in proc.stdout


def test_gpu_check_script_parses_and_rejects_bad_arguments():
    import subprocess
    from launch import REPO
    script = f"{REPO}/benchmarks/gpu_check.sh"
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    bad = subprocess.run(["bash", script, "--budget", "soon"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--budget must be whole seconds" in bad.stderr
    unknown = subprocess.run(["bash", script, "--fast"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown argument --fast" in unknown.stderr


def test_gpu_host_cost_bench_runs_on_the_stand_ins(tmp_path):
    """benchmarks/gpu_host_cost_bench.py times the CUDA path's host work on the stand-ins of
    tests/parallel/gpu_fakes.py: it must run here, every count through the GPU executor."""
    out = tmp_path / "host_cost.json"
    proc = run_ranks([1], [sys.executable, "benchmarks/gpu_host_cost_bench.py", "--reps", "5",
                           "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    data = json.loads(out.read_text())
    assert set(data["ratios"]) == {"gpu_path_host_us_per_tensor", "gpu_executor_us_per_tensor",
                                   "host_path_us_per_tensor"}
    assert all(v == v for v in data["ratios"].values())  # no NaN
    names = {r["name"] for r in data["results"]}
    assert {f"{k}_{n}_tensors" for k in ("gpu", "executor", "host")
            for n in (8, 32, 64, 161)} == names
    # One executor call per grouped allreduce: the GPU path really ran.
    assert all(r["reps"] == 5 for r in data["results"] if r["name"].startswith("executor"))
