"""TensorFlow and Keras: aiak_training.tensorflow and aiak_training.keras against raw MPI and
tf.distribute.MultiWorkerMirroredStrategy (MWMS), at 2 ranks on one machine, CPU.

The driver is rank-less and launches every job itself::

    OMP_NUM_THREADS=1 python benchmarks/tf_bench.py --launch all --json benchmarks/results/tf_2ranks_<date>.json

``--launch allreduce`` or ``--launch fit`` runs one part only.

Part 1, collectives (one ``mpiexec -n 2`` job; variants timed A B C A B C after warm-up in that
one launch, each sample barrier to barrier):

  raw_mpi_allreduce              one mpi4py Allreduce (in place, SUM) of one contiguous float32
                                 buffer as large as the ResNet-50-shaped gradient set (161
                                 tensors, 25,557,032 elements, 102 MB), as allreduce_bench.py.
  tf_grouped_allreduce_eager     hvd.grouped_allreduce (aiak_training.tensorflow, default op
                                 Average) of the same 161 tf.Tensors, called eagerly.
  tf_grouped_allreduce_tf_function  the same call inside a tf.function (traced once during
                                 warm-up; the graph runs one py_function op per call).

Part 1b, per-call host cost (one plain process, 1 rank, no mpiexec; ``--launch small``; the
variants timed A B C A B C after warm-up, one call per sample, --small-reps samples each):

  tf_grouped_allreduce_161x1_eager        hvd.grouped_allreduce (default op Average) of 161
                                          one-element float32 tf.Tensors, called eagerly: at
                                          one rank nothing travels, so this is the frontend's
                                          and the engine's per-call cost.  Target <= 1.0 ms.
  tf_grouped_allreduce_161x1_tf_function  the same inside a tf.function (traced in warm-up).
  torch_grouped_allreduce_161x1           aiak_training.torch.grouped_allreduce of 161
                                          one-element float32 torch tensors, for comparison
                                          (left out when torch is not installed).

  Ratio (info): tf_grouped_161x1_vs_torch = torch median / TF eager median.

Part 2, Keras ``model.fit`` (separate launches by nature: MWMS is not MPI).  The driver runs
--launches rounds; each round launches, in this order, A: MWMS (two local worker processes,
TF_CONFIG with two localhost ports), B: ours (``mpiexec -n 2``, DistributedOptimizer from
aiak_training.keras -- the implementation behind aiak_training.tensorflow.keras too -- with
BroadcastGlobalVariablesCallback), C: one plain Keras process on the
per-rank batch.  Every job trains the same model on the same global batch (C: half of it) of
synthetic data with SGD+momentum, ``jit_compile=False``, one TF intra-op thread per process.
A Keras callback in every process times the intervals between consecutive
``on_train_batch_end`` calls of a fit of --steps steps that follows an untimed warm-up fit of
--warmup-steps steps (same compiled train function), in wall time and in the process's CPU
time.  A launch's wall figure is rank 0's (the MWMS chief's) median interval; its CPU figure is
the sum over the job's processes of each one's median CPU time per step.  A row's median is
the median over the launches, min/max are over the launches, reps is the number of launches
(rows ending in _cpu hold the CPU figures).  Models:

  mlp   (HEADLINE) MLP 3072-1024-1024-1024-10 (ReLU) on flattened 32x32x3 images: 5.26M
        parameters in 8 tensors (21 MB), global batch 64.  Communication is a real part of
        the step: the ratios without suffix are this model's.
  cnn   ResNet-ish CNN for 32x32x3 images: 3x3 conv stem (32), three residual stages of two
        3x3 convs, widths 32/64/128 (stride 2 into stages 2 and 3, 1x1 projections), batch
        norm, global average pooling, dense 1024, dense 10: 0.45M parameters in 31 tensors
        (1.8 MB), global batch 64.  Compute-bound on a CPU (communication is a few percent
        of the step); its ratios carry the suffix _cnn.

Ratios (above 1 means aiak-training is better, except the four *_overhead* ones):

  tf_grouped_vs_raw_mpi           HEADLINE of part 1, eager: raw_mpi_allreduce median /
                                  tf_grouped_allreduce_eager median.  Target >= 0.8.
  tf_grouped_vs_raw_mpi_tf_function  the same with the tf.function variant.
  raw_out_of_place_vs_in_place    info: raw_mpi_allreduce median / raw_mpi_allreduce_out_of_place
                                  median, i.e. what tf_grouped_vs_raw_mpi would be for MPI
                                  itself if it had to leave its input alone (TF tensors are
                                  immutable, so every TF allreduce writes a new buffer).
  tf_grouped_vs_raw_mpi_out_of_place  info: raw_mpi_allreduce_out_of_place median /
                                  tf_grouped_allreduce_eager median.
  keras_fit_vs_mwms               mlp model: median MWMS step time / median step time of ours
                                  (model.fit at 2 ranks).  Target >= 1.0.
  keras_fit_overhead              mlp model: median step time of ours at 2 ranks / median step
                                  time of one process on the per-rank batch.  Lower is better;
                                  1.0 would mean data parallelism costs nothing per step.  On a
                                  2-core machine the 2 ranks share the CPU (one core each at
                                  best, while the single process has a core to itself and the
                                  other one idle), so this includes contention for memory
                                  bandwidth, caches and the cores themselves, not only the
                                  communication.
  keras_fit_cpu_vs_mwms           mlp model: CPU seconds per step of the MWMS job (both
                                  workers) / those of ours (both ranks).  Less sensitive than
                                  wall time to other load on the machine, and it shows what
                                  busy-polling costs (MPICH polls while it waits; the engine's
                                  background thread negotiates every HOROVOD_CYCLE_TIME).
  keras_fit_cpu_overhead          mlp model: CPU seconds per step of ours (both ranks) / twice
                                  those of the single process.  Lower is better; 1.0 means the
                                  two ranks together spend no more CPU than two independent
                                  single-process steps.
  the same four with the suffix _cnn for the cnn model.

Every fit row's params also hold the per-launch medians and the load average (1 min) before
each launch; the machine block holds the range of the load average over the run.
"""
import argparse
import importlib.metadata
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import mpiexec, read_json, run_jobs  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = os.path.abspath(__file__)

MODELS = ("mlp", "cnn")
# Ratios of the headline model carry no suffix (the keys the issue names).  The MLP is the
# headline because communication is a real part of its step; the CNN's is a few percent.
HEADLINE_MODEL = "mlp"
NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", choices=("all", "allreduce", "small", "fit"), default="all",
                   help="driver: which parts to launch (default all)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--reps", type=int, default=9, help="part 1: timed reps per variant (>= 5)")
    p.add_argument("--warmup", type=int, default=3, help="part 1: untimed reps per variant")
    p.add_argument("--small-reps", type=int, default=300,
                   help="part 1b: timed calls per variant (after --small-warmup untimed ones)")
    p.add_argument("--small-warmup", type=int, default=30,
                   help="part 1b: untimed calls per variant")
    p.add_argument("--launches", type=int, default=7,
                   help="part 2: rounds of launches (A B C per round; >= 5)")
    p.add_argument("--models", default=",".join(MODELS),
                   help="part 2: comma-separated models (mlp, cnn)")
    p.add_argument("--global-batch", type=int, default=64, help="part 2: global batch size")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="part 2: steps of the untimed first epoch")
    p.add_argument("--steps", type=int, default=41,
                   help="part 2: steps of the timed epoch (steps - 1 intervals are timed)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per launch")
    p.add_argument("--keras", choices=("3", "tf_keras"), default="3",
                   help="part 2: train with Keras 3, or with Keras 2 from tf_keras "
                        "(TF_USE_LEGACY_KERAS=1 in every job; same ratio keys)")
    # Internal: what a launched process does.
    p.add_argument("--worker", choices=("allreduce", "small", "hvd_fit", "mwms_fit",
                                        "single_fit"),
                   help=argparse.SUPPRESS)
    p.add_argument("--model", choices=MODELS, default="mlp", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--task-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ports", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None and (args.reps < 5 or args.launches < 5):
        p.error("--reps and --launches must be at least 5 (see docs/benchmarks/index.md)")
    if args.global_batch % 2:
        p.error("--global-batch must be even (2 ranks)")
    return args


# ---- the training jobs ------------------------------------------------------------------------
def _configure_tf() -> None:
    """Same threading for every job: with OMP_NUM_THREADS=1 the ranks get one compute thread
    each (2 processes on 2 cores); two inter-op threads, because a collective op (ours or
    MWMS's) occupies one while it waits."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)


def _keras():
    """The Keras the jobs train with: Keras 3, or Keras 2 from tf_keras with --keras tf_keras
    (the driver then sets TF_USE_LEGACY_KERAS=1 for every job)."""
    if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
        import tf_keras
        return tf_keras
    import keras
    return keras


def _legacy_keras() -> bool:
    return os.environ.get("TF_USE_LEGACY_KERAS") == "1"


def _build_model(kind: str, base: Optional[type] = None):
    keras = _keras()
    layers = keras.layers
    base = base or keras.Model
    if kind == "mlp":
        inp = keras.Input(IMAGE_SHAPE)
        x = layers.Flatten()(inp)
        for _ in range(3):
            x = layers.Dense(1024, activation="relu")(x)
        return base(inp, layers.Dense(NUM_CLASSES)(x))

    def conv_bn(x, width: int, stride: int = 1, kernel: int = 3, relu: bool = True):
        x = layers.Conv2D(width, kernel, strides=stride, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x) if relu else x

    inp = keras.Input(IMAGE_SHAPE)
    x = conv_bn(inp, 32)
    for width, stride in ((32, 1), (64, 2), (128, 2)):
        shortcut = x if stride == 1 and x.shape[-1] == width else conv_bn(
            x, width, stride, kernel=1, relu=False)
        y = conv_bn(x, width, stride)
        y = conv_bn(y, width, relu=False)
        x = layers.ReLU()(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(1024, activation="relu")(x)
    return base(inp, layers.Dense(NUM_CLASSES)(x))


def _data(batch: int, seed: int):
    """Synthetic images and labels, ``batch``-sized batches, repeated without end.  Eight
    batches' worth in memory; the pipeline is the same for every job."""
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8 * batch,) + IMAGE_SHAPE, dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, 8 * batch).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
    options = tf.data.Options()
    # MWMS: every worker reads its own copy (data are synthetic) and the strategy splits each
    # global batch into per-replica halves; sharding by files would find none.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options), (x[:batch], y[:batch])


def _compile(model, optimizer) -> None:
    keras = _keras()
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)


def _step_timer():
    """A callback that keeps the intervals between consecutive batch ends (so each interval
    holds everything a step costs: input, train function, callbacks), in wall time and in
    this process's CPU time (all its threads: compute, collectives, MPI polling)."""
    keras = _keras()

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.last: Optional[Tuple[float, float]] = None
            self.intervals: List[float] = []
            self.cpu_intervals: List[float] = []

        def on_train_batch_end(self, batch, logs=None) -> None:
            now = (time.perf_counter(), time.process_time())
            if self.last is not None:
                self.intervals.append(now[0] - self.last[0])
                self.cpu_intervals.append(now[1] - self.last[1])
            self.last = now
    return StepTimer()


def _write(path: str, payload: Dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f)


def _fit_payload(model, timer, per_replica: int, replicas: int) -> Dict:
    params = sum(int(math.prod(v.shape)) for v in model.trainable_variables)
    return {"intervals": timer.intervals, "median_s": statistics.median(timer.intervals),
            "cpu_median_s": statistics.median(timer.cpu_intervals),
            "trainable_params": params, "trainable_tensors": len(model.trainable_variables),
            "per_replica_batch": per_replica, "replicas": replicas}


def _timed_fit(model, ds, args: argparse.Namespace, callbacks: List[Any]):
    """An untimed warm-up fit of ``warmup_steps`` (traces the train function; a broadcast
    callback runs here), then a fit of ``steps`` steps whose batch-end intervals are timed.
    The second fit reuses the compiled train function."""
    model.fit(ds, epochs=1, steps_per_epoch=args.warmup_steps, verbose=0, callbacks=callbacks)
    timer = _step_timer()
    model.fit(ds, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[timer])
    return timer


def worker_single_fit(args: argparse.Namespace) -> None:
    _configure_tf()
    keras = _keras()
    batch = args.global_batch // 2
    model = _build_model(args.model)
    _compile(model, keras.optimizers.SGD(0.01, momentum=0.9))
    ds, _ = _data(batch, seed=0)
    timer = _timed_fit(model, ds, args, [])
    _write(f"{args.out}.0", _fit_payload(model, timer, batch, 1))


def worker_hvd_fit(args: argparse.Namespace) -> None:
    _configure_tf()
    import tensorflow as tf
    keras = _keras()
    import aiak_training.keras as hvd
    hvd.init()
    batch = args.global_batch // hvd.size()
    model = _build_model(args.model)
    _compile(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)))
    ds, _ = _data(batch, seed=hvd.rank())
    timer = _timed_fit(model, ds, args, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    # The ranks must agree after training: a cheap check that the gradients were combined.
    first = model.trainable_variables[0]
    gathered = hvd.allgather(tf.reshape(tf.convert_to_tensor(first), (1, -1)),
                             name="bench_check")
    g = tf.convert_to_tensor(gathered).numpy()
    if not (g[0] == g[1:]).all():
        raise SystemExit("tf_bench: the ranks' weights differ after fit")
    # Every rank writes its own file: the driver adds up the ranks' CPU time.
    _write(f"{args.out}.{hvd.rank()}", _fit_payload(model, timer, batch, hvd.size()))
    hvd.shutdown()


def worker_mwms_fit(args: argparse.Namespace) -> None:
    ports = args.ports.split(",")
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in ports]},
        "task": {"type": "worker", "index": args.task_index}})
    _configure_tf()
    import tensorflow as tf
    keras = _keras()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ds, sample = _data(args.global_batch, seed=args.task_index)
    per_replica = args.global_batch // strategy.num_replicas_in_sync

    class MWMSModel(keras.Model):
        """Two workarounds for Keras 3.15's MWMS support (keras-team/keras#20585), neither of
        which runs per step beyond a reshape of the logged scalars."""

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            # Keras reduces a distributed (x, y) batch with strategy.reduce, which MWMS
            # cannot do for a tuple; build from a local batch instead.
            with self.distribute_strategy.scope():
                self._symbolic_build(data_batch=sample)

        def train_step(self, data):
            # Keras reduces the logs across workers with strategy.reduce(axis=0), which fails
            # on scalars: give them a length-1 axis (the mean over it is the same value).
            logs = super().train_step(data)
            return {k: tf.reshape(v, [1]) for k, v in logs.items()}

    with strategy.scope():
        # Keras 2 (tf_keras) supports MWMS as it is; the workarounds are Keras 3's.
        model = _build_model(args.model, None if _legacy_keras() else MWMSModel)
        _compile(model, keras.optimizers.SGD(0.01, momentum=0.9))
    timer = _timed_fit(model, ds, args, [])
    _write(f"{args.out}.{args.task_index}", _fit_payload(model, timer, per_replica,
                                                         strategy.num_replicas_in_sync))


# ---- the collectives job ----------------------------------------------------------------------
def worker_allreduce(args: argparse.Namespace) -> None:
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    import aiak_training.tensorflow as hvd
    from bench_common import interleave, resnet50_shapes, summarize, timed

    _configure_tf()
    hvd.init()
    comm = MPI.COMM_WORLD
    barrier = comm.Barrier
    shapes = resnet50_shapes()
    total = sum(math.prod(s) for s in shapes)
    rng = np.random.default_rng(comm.Get_rank())
    tensors = [tf.constant(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    raw = rng.random(total, dtype=np.float32)

    # Correctness once, untimed: the grouped average equals numpy's average of both ranks'.
    first = hvd.grouped_allreduce(tensors[:2], name="check")[0].numpy()
    expect = comm.allreduce(tensors[0].numpy(), op=MPI.SUM) / comm.Get_size()
    if not np.allclose(first, expect, rtol=1e-6, atol=1e-6):
        raise SystemExit("tf_bench: grouped_allreduce gave a wrong result")

    @tf.function
    def grouped_graph(ts):
        return hvd.grouped_allreduce(ts, name="rn50_graph")

    raw_out = np.empty_like(raw)
    raw_out.fill(0)  # faulted in before timing, as a reused result buffer would be

    def raw_mpi() -> float:
        return timed(lambda: comm.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM), barrier)

    def raw_mpi_out_of_place() -> float:
        return timed(lambda: comm.Allreduce(raw, raw_out, op=MPI.SUM), barrier)

    def eager() -> float:
        return timed(lambda: hvd.grouped_allreduce(tensors, name="rn50"), barrier)

    def graph() -> float:
        # A tf.function call returns once its ops have run (CPU, synchronous executor).
        return timed(lambda: grouped_graph(tensors), barrier)

    variants = {"raw_mpi_allreduce": raw_mpi, "tf_grouped_allreduce_eager": eager,
                "tf_grouped_allreduce_tf_function": graph,
                "raw_mpi_allreduce_out_of_place": raw_mpi_out_of_place}
    times = interleave(variants, args.reps, args.warmup)
    params = {"raw_mpi_allreduce": {"bytes": total * 4, "tensors": 1, "op": "SUM in place"},
              "raw_mpi_allreduce_out_of_place": {"bytes": total * 4, "tensors": 1,
                                                 "op": "SUM, send and receive buffers"},
              "tf_grouped_allreduce_eager": {"bytes": total * 4, "tensors": len(shapes),
                                             "op": "Average"},
              "tf_grouped_allreduce_tf_function": {"bytes": total * 4, "tensors": len(shapes),
                                                   "op": "Average"}}
    if comm.Get_rank() == 0:
        _write(args.out, {"results": [summarize(k, params[k], v) for k, v in times.items()]})
    hvd.shutdown()


SMALL_TENSORS = 161


def worker_small(args: argparse.Namespace) -> None:
    """Part 1b: per-call time of a grouped allreduce of many one-element tensors at 1 rank."""
    import tensorflow as tf

    import aiak_training.tensorflow as hvd
    from bench_common import interleave, summarize

    _configure_tf()
    hvd.init()
    tensors = [tf.constant([float(i)]) for i in range(SMALL_TENSORS)]
    got = [float(t.numpy()[0]) for t in hvd.grouped_allreduce(tensors, name="small_check")]
    if got != [float(i) for i in range(SMALL_TENSORS)]:
        raise SystemExit("tf_bench: small grouped_allreduce gave a wrong result")

    @tf.function
    def grouped_graph(ts):
        return hvd.grouped_allreduce(ts)

    def one_call(fn: Callable[[], Any]) -> Callable[[], float]:
        def sample() -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return sample

    variants = {"tf_grouped_allreduce_161x1_eager":
                    one_call(lambda: hvd.grouped_allreduce(tensors)),
                "tf_grouped_allreduce_161x1_tf_function":
                    one_call(lambda: grouped_graph(tensors))}
    try:
        import torch

        import aiak_training.torch as hvd_torch
    except ImportError:
        hvd_torch = None
    if hvd_torch is not None:
        hvd_torch.init()
        torch_tensors = [torch.full((1,), float(i)) for i in range(SMALL_TENSORS)]
        variants["torch_grouped_allreduce_161x1"] = one_call(
            lambda: hvd_torch.grouped_allreduce(torch_tensors))
    times = interleave(variants, args.small_reps, args.small_warmup)
    params = {"tensors": SMALL_TENSORS, "elements_each": 1, "dtype": "float32",
              "op": "Average", "ranks": 1, "sample": "one call"}
    _write(args.out, {"results": [summarize(k, params, v) for k, v in times.items()]})
    hvd.shutdown()


# ---- the driver -------------------------------------------------------------------------------
def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["KERAS_BACKEND"] = "tensorflow"
    env.pop("TF_CONFIG", None)
    return env


def _free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _worker_argv(args: argparse.Namespace, worker: str, out: str, model: str = "mlp",
                 extra: Sequence[str] = ()) -> List[str]:
    return [sys.executable, SELF, "--worker", worker, "--out", out, "--model", model,
            "--reps", str(args.reps), "--warmup", str(args.warmup),
            "--small-reps", str(args.small_reps), "--small-warmup", str(args.small_warmup),
            "--global-batch", str(args.global_batch), "--warmup-steps", str(args.warmup_steps),
            "--steps", str(args.steps)] + list(extra)


def _run(cmds: List[List[str]], timeout: float, what: str) -> None:
    """Start ``cmds`` together and wait for all (the harness's :func:`run_jobs`)."""
    run_jobs(cmds, f"tf_bench: {what}", timeout=timeout, env=_env(), cwd=REPO)


def launch_allreduce(args: argparse.Namespace, tmp: str) -> Tuple[List[Dict], Dict[str, float]]:
    out = os.path.join(tmp, "allreduce.json")
    _run([[mpiexec(), "-n", "2"] + _worker_argv(args, "allreduce", out)], args.timeout,
         "the allreduce job")
    results = read_json(out)["results"]
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {"tf_grouped_vs_raw_mpi": med["raw_mpi_allreduce"] / med["tf_grouped_allreduce_eager"],
              "tf_grouped_vs_raw_mpi_tf_function":
                  med["raw_mpi_allreduce"] / med["tf_grouped_allreduce_tf_function"],
              "raw_out_of_place_vs_in_place":
                  med["raw_mpi_allreduce"] / med["raw_mpi_allreduce_out_of_place"],
              "tf_grouped_vs_raw_mpi_out_of_place":
                  med["raw_mpi_allreduce_out_of_place"] / med["tf_grouped_allreduce_eager"]}
    return results, ratios


def launch_small(args: argparse.Namespace, tmp: str) -> Tuple[List[Dict], Dict[str, float]]:
    out = os.path.join(tmp, "small.json")
    _run([_worker_argv(args, "small", out)], args.timeout, "the small-tensor job")
    results = read_json(out)["results"]
    med = {r["name"]: r["median_s"] for r in results}
    ratios = {}
    if "torch_grouped_allreduce_161x1" in med:
        ratios["tf_grouped_161x1_vs_torch"] = (med["torch_grouped_allreduce_161x1"] /
                                               med["tf_grouped_allreduce_161x1_eager"])
    return results, ratios


FIT_VARIANTS = ("mwms", "hvd", "single")


def _launch_fit_job(args: argparse.Namespace, variant: str, model: str, out: str) -> None:
    if variant == "hvd":
        _run([[mpiexec(), "-n", "2"] + _worker_argv(args, "hvd_fit", out, model)],
             args.timeout, f"the aiak fit job ({model})")
    elif variant == "single":
        _run([_worker_argv(args, "single_fit", out, model)], args.timeout,
             f"the single-process fit job ({model})")
    else:
        ports = ",".join(str(p) for p in _free_ports(2))
        _run([_worker_argv(args, "mwms_fit", out, model,
                           ["--task-index", str(i), "--ports", ports]) for i in range(2)],
             args.timeout, f"the MWMS fit job ({model})")


def _read_processes(out: str, count: int) -> List[Dict]:
    return [read_json(f"{out}.{i}") for i in range(count)]


def launch_fit(args: argparse.Namespace, tmp: str, loads: List[float]
               ) -> Tuple[List[Dict], Dict[str, float]]:
    from bench_common import summarize
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    procs = {"mwms": 2, "hvd": 2, "single": 1}
    # runs[(model, variant)]: one entry per launch, the payloads of its processes (rank 0
    # or the MWMS chief first).
    runs: Dict[Tuple[str, str], List[List[Dict]]] = {
        (m, v): [] for m in models for v in FIT_VARIANTS}
    load_before: Dict[Tuple[str, str], List[float]] = {k: [] for k in runs}
    for rnd in range(args.launches):
        for model in models:
            for variant in FIT_VARIANTS:  # A B C, every round
                out = os.path.join(tmp, f"fit_{model}_{variant}_{rnd}.json")
                load = os.getloadavg()[0]
                loads.append(load)
                load_before[(model, variant)].append(round(load, 2))
                _launch_fit_job(args, variant, model, out)
                payloads = _read_processes(out, procs[variant])
                runs[(model, variant)].append(payloads)
                print(f"# round {rnd + 1}/{args.launches} {model} {variant}: median step "
                      f"{payloads[0]['median_s'] * 1e3:.2f} ms, CPU "
                      f"{sum(p['cpu_median_s'] for p in payloads) * 1e3:.2f} ms "
                      f"(load {load:.2f})", flush=True)
    loads.append(os.getloadavg()[0])
    names = {"mwms": "keras_fit_mwms", "hvd": "keras_fit_aiak", "single": "keras_fit_1proc"}
    results, ratios = [], {}
    for model in models:
        wall, cpu = {}, {}
        for variant in FIT_VARIANTS:
            launches = runs[(model, variant)]
            per_launch = [ps[0]["median_s"] for ps in launches]
            per_launch_cpu = [sum(p["cpu_median_s"] for p in ps) for ps in launches]
            first = launches[0][0]
            params = {"model": model, "trainable_params": first["trainable_params"],
                      "trainable_bytes": first["trainable_params"] * 4,
                      "trainable_tensors": first["trainable_tensors"],
                      "replicas": first["replicas"],
                      "per_replica_batch": first["per_replica_batch"],
                      "global_batch": first["per_replica_batch"] * first["replicas"],
                      "timed_intervals_per_launch": len(first["intervals"]),
                      "warmup_steps": args.warmup_steps,
                      "per_launch_median_s": [round(t, 6) for t in per_launch],
                      "load_avg_1m_before_launch": load_before[(model, variant)]}
            row = summarize(f"{names[variant]}_{model}", params, per_launch)
            results.append(row)
            wall[variant] = row["median_s"]
            cpu_row = summarize(f"{names[variant]}_{model}_cpu",
                                {"model": model, "what": "CPU seconds per step, summed over "
                                 "the job's processes (median over a launch's steps, per "
                                 "process)", "processes": procs[variant],
                                 "per_launch_s": [round(t, 6) for t in per_launch_cpu]},
                                per_launch_cpu)
            results.append(cpu_row)
            cpu[variant] = cpu_row["median_s"]
        suffix = "" if model == HEADLINE_MODEL else f"_{model}"
        ratios[f"keras_fit_vs_mwms{suffix}"] = wall["mwms"] / wall["hvd"]
        ratios[f"keras_fit_overhead{suffix}"] = wall["hvd"] / wall["single"]
        ratios[f"keras_fit_cpu_vs_mwms{suffix}"] = cpu["mwms"] / cpu["hvd"]
        ratios[f"keras_fit_cpu_overhead{suffix}"] = cpu["hvd"] / (2 * cpu["single"])
        # Robustness check, not a headline: the rounds' own ratios (adjacent launches).
        hvd_row = next(r for r in results if r["name"] == f"keras_fit_aiak_{model}")
        hvd_row["params"]["per_round_mwms_over_aiak"] = [
            round(a[0]["median_s"] / b[0]["median_s"], 4)
            for a, b in zip(runs[(model, "mwms")], runs[(model, "hvd")])]
    return results, ratios


def _version(*dists: str) -> Optional[str]:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def driver(args: argparse.Namespace) -> None:
    # The header reads the MPI library's version without starting MPI in this rank-less
    # process (MPI_Get_library_version may be called before MPI_Init).
    import mpi4py
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from bench_common import machine_info, report

    loads: List[float] = [os.getloadavg()[0]]
    results: List[Dict] = []
    ratios: Dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tf_bench_") as tmp:
        if args.launch in ("all", "allreduce"):
            r, q = launch_allreduce(args, tmp)
            results += r
            ratios.update(q)
            loads.append(os.getloadavg()[0])
        if args.launch in ("all", "small"):
            r, q = launch_small(args, tmp)
            results += r
            ratios.update(q)
            loads.append(os.getloadavg()[0])
        if args.launch in ("all", "fit"):
            r, q = launch_fit(args, tmp, loads)
            results += r
            ratios.update(q)
    machine = machine_info(2, "1x2")
    machine["tensorflow"] = _version("tensorflow-cpu", "tensorflow")
    machine["keras"] = (f"tf_keras {_version('tf-keras', 'tf_keras')} (TF_USE_LEGACY_KERAS=1)"
                        if args.keras == "tf_keras" else _version("keras"))
    machine["omp_num_threads"] = _env()["OMP_NUM_THREADS"]
    machine["load_avg_1m"] = f"{min(loads):.2f}-{max(loads):.2f}"
    # Engine settings that reach the ranks through the environment (e.g. HOROVOD_CYCLE_TIME).
    machine["horovod_env"] = {k: v for k, v in sorted(os.environ.items())
                              if k.startswith(("HOROVOD_", "AIAK_"))} or None
    report("tf_bench", machine, results, ratios, args.json)


def main() -> None:
    args = parse_args()
    if args.keras == "tf_keras":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # every job inherits it (_env copies it)
    workers = {"allreduce": worker_allreduce, "small": worker_small, "hvd_fit": worker_hvd_fit,
               "mwms_fit": worker_mwms_fit, "single_fit": worker_single_fit}
    if args.worker:
        workers[args.worker](args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
