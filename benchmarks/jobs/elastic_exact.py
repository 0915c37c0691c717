"""Elastic training whose result can be replayed exactly (tests/test_elastic*.py, the Ray and
Spark tests, benchmarks/elastic_bench.py).

A float64 linear model trained by SGD with momentum, fed by ``hvd.elastic.ElasticSampler``,
kept in a ``TorchState`` with the sampler and a ``history`` of committed steps.  Each rank's
gradient is rounded to a multiple of 2**-20 before the Sum allreduce, so the sum is exact in
any order and a single process can replay the run bit for bit from ``history`` (one entry
per committed step: epoch, world size, every rank's sample indices).

Environment: ``OUT`` (rank 0 writes the result JSON there at the end), ``PROGRESS`` (rank 0
rewrites the number of committed steps there after each commit), ``EPOCHS``, ``STEP_SLEEP``
(seconds per step, so that a test can act mid-epoch), ``COMMIT_EVERY`` (steps per commit),
``STEPS_LOG`` (rank 0 appends ``time size steps params...`` after every step;
elastic_bench.py), ``ELASTIC_EXACT_HOROVOD=1`` (``import horovod.torch``, for
``aiakrun --horovod-compat``).
"""
import json
import os
import time
from typing import List, Sequence

import torch

N_SAMPLES = 48
BATCH = 2
FEATURES = 4
SEED = 7
LR = 2.0 ** -6
MOMENTUM = 0.5
SCALE = 2.0 ** -4
QUANTUM = 2.0 ** 20


def dataset():
    """Deterministic small-integer data: (x [N, F], y [N])."""
    x = torch.tensor([[((i * 7 + j * 3) % 11) - 5 for j in range(FEATURES)]
                      for i in range(N_SAMPLES)], dtype=torch.float64)
    y = torch.tensor([((i * 3) % 5) - 2 for i in range(N_SAMPLES)], dtype=torch.float64)
    return x, y


def make_model_and_optimizer():
    model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.25, -0.5, 0.125, 0.75]], dtype=torch.float64))
        model.bias.fill_(0.5)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def local_grad(model, indices: Sequence[int]) -> List[torch.Tensor]:
    """This rank's gradient of the squared error over ``indices``, quantized (exact sums)."""
    x, y = dataset()
    idx = torch.tensor(list(indices), dtype=torch.long)
    with torch.no_grad():
        residual = x[idx] @ model.weight[0] + model.bias[0] - y[idx]
        grads = [2 * (residual @ x[idx]).reshape(1, FEATURES), (2 * residual.sum()).reshape(1)]
    return [torch.round(g * QUANTUM) / QUANTUM for g in grads]


def apply(model, optimizer, summed: Sequence[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), summed):
        p.grad = g * SCALE
    optimizer.step()


def replay(history) -> List[float]:
    """The parameters a run with this ``history`` must end with (single process)."""
    torch.set_num_threads(1)
    model, optimizer = make_model_and_optimizer()
    for _epoch, _size, per_rank in history:
        parts = [local_grad(model, idx) for idx in per_rank]
        summed = [sum(p[k] for p in parts) for k in range(2)]
        apply(model, optimizer, summed)
    return [float(v) for v in torch.cat([p.detach().reshape(-1) for p in model.parameters()])]


def main() -> dict:
    torch.set_num_threads(1)
    if os.environ.get("ELASTIC_EXACT_HOROVOD") == "1":
        # An unmodified Elastic Horovod script (aiakrun --horovod-compat).
        import horovod.torch as hvd
    else:
        import aiak_training.torch as hvd
    hvd.init()
    epochs = int(os.environ.get("EPOCHS", "2"))
    step_sleep = float(os.environ.get("STEP_SLEEP", "0.1"))
    commit_every = int(os.environ.get("COMMIT_EVERY", "2"))
    steps_log = os.environ.get("STEPS_LOG")  # rank 0 appends "time size steps" per step
    model, optimizer = make_model_and_optimizer()
    sampler = hvd.elastic.ElasticSampler(list(range(N_SAMPLES)), shuffle=True, seed=SEED)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, history=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    def progress() -> None:
        path = os.environ.get("PROGRESS")
        if path and hvd.rank() == 0:
            with open(path + ".tmp", "w") as f:
                f.write(f"{len(state.history)} {hvd.size()}\n")
            os.replace(path + ".tmp", path)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            batches = (len(state.sampler) + BATCH - 1) // BATCH
            for b in range(batches):
                indices = state.sampler.get_indices(b, BATCH)
                summed = [hvd.allreduce(g, op=hvd.Sum, name=f"grad{k}")
                          for k, g in enumerate(local_grad(state.model, indices))]
                everyone = hvd.allgather_object(list(indices), name="indices")
                apply(state.model, state.optimizer, summed)
                state.sampler.record_batch(b, BATCH)
                state.history.append((state.epoch, hvd.size(), everyone))
                if steps_log and hvd.rank() == 0:
                    with open(steps_log, "a") as f:
                        params = torch.cat([p.detach().reshape(-1)
                                            for p in state.model.parameters()])
                        f.write(f"{time.time():.6f} {hvd.size()} {len(state.history)} "
                                + " ".join(repr(float(v)) for v in params) + "\n")
                time.sleep(step_sleep)
                if len(state.history) % commit_every == 0:
                    state.commit()
                    progress()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            progress()

    train(state)
    print(f"rank {hvd.rank()} of {hvd.size()} done: {len(state.history)} steps, "
          f"resets to sizes {resets}", flush=True)
    params = [float(v) for v in torch.cat([p.detach().reshape(-1)
                                           for p in state.model.parameters()])]
    result = {"params": params, "history": state.history, "size": hvd.size()}
    if hvd.rank() == 0 and os.environ.get("OUT"):
        with open(os.environ["OUT"], "w") as f:
            json.dump(result, f)
    # Function jobs (Ray, Spark) take the result from the return value.
    return dict(result, rank=hvd.rank())


if __name__ == "__main__":
    main()
