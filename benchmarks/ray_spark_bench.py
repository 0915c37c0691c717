"""Ray and Spark front ends: step time against aiakrun, and start-up overheads.

Figures (``ratios`` in the JSON; above 1 is better for aiak-training's engine path):

* ``ray_vs_aiakrun_step``: median step time of the digits model (examples/digits_train.py,
  2 ranks) under ``aiakrun -np 2`` divided by the same under ``RayExecutor(num_workers=2)``.
  Target >= 0.9.  Both use their default transport: MPI for aiakrun, and for the Ray
  workers MPI where MPICH is installed (the JSON's ``machine.ray_transports`` says which).
  ``--aiakrun-gloo`` adds ``aiakrun --gloo`` and a Ray executor over Gloo, and reports
  ``ray_gloo_vs_aiakrun_gloo_step`` (the same ratio, both over Gloo).  Repetitions
  alternate the variants in this one launch; each repetition trains ``--epochs`` epochs,
  the first epoch is warm-up, and the repetition's figure is the median of rank 0's
  remaining step times.
* ``ray_start_s`` (reported, seconds): ``RayExecutor(num_workers=4).start()`` until it returns,
  i.e. all 4 actors placed, numbered and holding their environment (median of --reps).
* ``spark_run_overhead_s`` (reported, seconds): from calling ``aiak_training.spark.run`` with
  ``--spark-procs`` ranks to the first line of user code having run on every rank (median).

    python benchmarks/ray_spark_bench.py --json benchmarks/results/ray_spark_2026-11-26.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))
import bench_common  # noqa: E402
import digits_train  # noqa: E402


def _steps_median(result, epochs):
    per_epoch = len(result["step_times"]) // epochs
    return statistics.median(result["step_times"][per_epoch:])  # epoch 1 is warm-up


def aiakrun_step(epochs, gloo=False):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(["aiakrun"] + (["--gloo"] if gloo else []) + ["-np", "2", sys.executable,
                        os.path.join(REPO, "examples", "digits_train.py"), "--epochs",
                        str(epochs), "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL, timeout=600)
        with open(out.name) as f:
            return _steps_median(json.load(f), epochs)


def first_line_time():
    return time.time()


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--spark-procs", type=int, default=2)
    p.add_argument("--skip-spark", action="store_true")
    p.add_argument("--aiakrun-gloo", action="store_true",
                   help="also time `aiakrun --gloo` and Ray workers over Gloo "
                        "(AIAK_RAY_TRANSPORT=gloo), and report ray_gloo_vs_aiakrun_gloo_step")
    p.add_argument("--json")
    args = p.parse_args()

    import cloudpickle
    import ray
    from aiak_training.ray import RayExecutor
    cloudpickle.register_pickle_by_value(digits_train)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    results, ratios = [], {}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    settings = RayExecutor.create_settings(timeout_s=60)

    # ray_start_s: 4 workers, start() until it returns.
    starts = []
    for _ in range(args.reps):
        ex = RayExecutor(settings, num_workers=4)
        t0 = time.perf_counter()
        ex.start()
        starts.append(time.perf_counter() - t0)
        ex.shutdown()
    results.append(bench_common.summarize("ray_start_4_workers", {"workers": 4}, starts))
    ratios["ray_start_s"] = statistics.median(starts)

    # ray_vs_aiakrun_step: alternating aiakrun and Ray repetitions.  The executor uses its
    # default transport (MPI where MPICH is installed); --aiakrun-gloo adds a Gloo executor.
    executors = {"ray_executor_2workers": RayExecutor(settings, num_workers=2)}
    if args.aiakrun_gloo:
        executors["ray_executor_gloo_2workers"] = RayExecutor(settings, num_workers=2)
    transports = {}
    try:
        for name, ex in executors.items():
            os.environ["AIAK_RAY_TRANSPORT"] = "gloo" if "gloo" in name else "auto"
            ex.start()
            transports[name] = ex.transport
        os.environ.pop("AIAK_RAY_TRANSPORT")

        def ray_step(ex):
            res = ex.run(digits_train.train, kwargs=dict(epochs=args.epochs, verbose=False))
            return _steps_median(res[0], args.epochs)

        variants = {"aiakrun_mpi_2ranks": lambda: aiakrun_step(args.epochs)}
        for name, ex in executors.items():
            variants[name] = lambda ex=ex: ray_step(ex)
        if args.aiakrun_gloo:
            variants["aiakrun_gloo_2ranks"] = lambda: aiakrun_step(args.epochs, gloo=True)
        times = bench_common.interleave(variants, reps=args.reps, warmup=1)
    finally:
        for ex in executors.values():
            ex.shutdown()
    ray.shutdown()
    params = {"model": "digits MLP 64-128-64-10", "batch": 32, "ranks": 2,
              "epochs": args.epochs}
    for name, samples in times.items():
        results.append(bench_common.summarize(f"step_{name}", params, samples))
    ratios["ray_vs_aiakrun_step"] = (statistics.median(times["aiakrun_mpi_2ranks"])
                                     / statistics.median(times["ray_executor_2workers"]))
    if args.aiakrun_gloo:
        ratios["ray_gloo_vs_aiakrun_gloo_step"] = (
            statistics.median(times["aiakrun_gloo_2ranks"])
            / statistics.median(times["ray_executor_gloo_2workers"]))

    if not args.skip_spark:
        from pyspark.sql import SparkSession
        import aiak_training.spark as aiak_spark
        spark = (SparkSession.builder.master("local[4]").config("spark.ui.enabled", "false")
                 .config("spark.ui.showConsoleProgress", "false").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        try:
            overheads = []
            for _ in range(args.reps + 1):
                t0 = time.time()
                firsts = aiak_spark.run(first_line_time, num_proc=args.spark_procs)
                overheads.append(max(firsts) - t0)
            overheads = overheads[1:]  # the first run also starts Spark's Python workers
        finally:
            spark.stop()
        results.append(bench_common.summarize("spark_run_to_first_line_all_ranks",
                                              {"ranks": args.spark_procs}, overheads))
        ratios["spark_run_overhead_s"] = statistics.median(overheads)

    machine = bench_common.machine_info(ranks=2, layout="1x2")
    machine["ray"] = ray.__version__
    try:
        import pyspark
        machine["pyspark"] = pyspark.__version__
    except ImportError:
        pass
    machine["load_avg_1m"] = os.getloadavg()[0]
    machine["ray_transports"] = transports
    bench_common.report("ray_spark", machine, results, ratios, args.json)


if __name__ == "__main__":
    main()
