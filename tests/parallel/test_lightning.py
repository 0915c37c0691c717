"""aiak_training.lightning's strategy in a Lightning 2 Trainer, every rank.

Run at 2 ranks by tests/test_lightning.py with AIAK_TEST_TMPDIR (a directory the ranks
share).  References are computed without Lightning: a plain ``DistributedOptimizer`` loop over
the batches Lightning's distributed sampler gives this rank, or the whole data set's values
computed locally by every rank.
"""
import os
import warnings
from typing import List

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import aiak_training.torch as hvd
from aiak_training.lightning import AiakStrategy, strategy_class
from aiak_training.lightning.environment import start_runtime

pl = pytest.importorskip("lightning.pytorch")

SAMPLES, FEATURES, CLASSES, BATCH, LR = 64, 8, 4, 8, 0.1


def data() -> TensorDataset:
    """Features, labels and each sample's index; the same on every rank."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return TensorDataset(x, y, torch.arange(SAMPLES))


def make_net(seed: int) -> torch.nn.Module:
    """A different initialisation on each rank unless the strategy broadcasts rank 0's."""
    torch.manual_seed(seed + 100 * hvd.rank())
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, CLASSES))


def loader(dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, shuffle=True)


def make_module(pl_package, seed: int = 0):
    """A LightningModule class of ``pl_package`` (lightning.pytorch or pytorch_lightning)."""

    class Module(pl_package.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net(seed)
            self.seen: List[int] = []
            self.started_at_step = None

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            self.seen += idx.tolist()
            return F.cross_entropy(self.net(x), y)

        def on_train_start(self):
            self.started_at_step = self.trainer.global_step

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    return Module()


def trainer(pl_package=pl, epochs: int = 1, **kwargs):
    options = dict(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False)
    options.update(kwargs)
    strategy = options.pop("strategy", None) or AiakStrategy(package=pl_package.__name__)
    return pl_package.Trainer(strategy=strategy, **options)


def weights(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def plain_loop(epochs: int, seed: int = 0, clip: float = 0.0, accumulate: int = 1
               ) -> torch.Tensor:
    """The reference: rank 0's initial weights, the sampler Lightning injects, SGD wrapped by
    DistributedOptimizer, one step per ``accumulate`` batches (each loss divided by it, as
    Lightning does)."""
    net = make_net(seed)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                         named_parameters=net.named_parameters(),
                                         backward_passes_per_step=accumulate)
    dataset = data()
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=True, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for i, (x, y, _) in enumerate(DataLoader(dataset, batch_size=BATCH, sampler=sampler)):
            if i % accumulate == 0:
                optimizer.zero_grad()
            (F.cross_entropy(net(x), y) / accumulate).backward()
            if (i + 1) % accumulate:
                continue
            if clip:
                optimizer.synchronize()
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
    return weights(net)


def same_on_every_rank(value: torch.Tensor) -> bool:
    gathered = hvd.allgather(value.unsqueeze(0))
    return all(torch.equal(gathered[0], row) for row in gathered)


# ---------------------------------------------------------------- rank, world, collectives
def test_rank_and_world_come_from_the_runtime():
    strategy = AiakStrategy(package="lightning.pytorch")
    assert (strategy.global_rank, strategy.world_size) == (hvd.rank(), hvd.size())
    assert (strategy.local_rank, strategy.node_rank) == (hvd.local_rank(), hvd.cross_rank())
    assert strategy.distributed_sampler_kwargs == {"num_replicas": hvd.size(),
                                                   "rank": hvd.rank()}
    assert strategy.is_global_zero == (hvd.rank() == 0)
    assert strategy.cluster_environment.creates_processes_externally


def test_reduce_all_gather_broadcast_barrier():
    strategy = AiakStrategy(package="lightning.pytorch")
    mine = torch.tensor([float(hvd.rank() + 1), 10.0 * hvd.rank()])
    everyone = [torch.tensor([float(r + 1), 10.0 * r]) for r in range(hvd.size())]
    stacked = torch.stack(everyone)
    assert torch.equal(strategy.reduce(mine, reduce_op="sum"), stacked.sum(0))
    assert torch.allclose(strategy.reduce(mine), stacked.mean(0))
    assert torch.equal(strategy.reduce(mine, reduce_op="max"), stacked.max(0).values)
    assert torch.equal(strategy.reduce(mine, reduce_op=torch.distributed.ReduceOp.MIN),
                       stacked.min(0).values)
    assert strategy.reduce(torch.tensor(hvd.rank() + 1)).item() == pytest.approx(
        sum(range(1, hvd.size() + 1)) / hvd.size())
    assert strategy.reduce("not a tensor") == "not a tensor"
    with pytest.raises(ValueError, match="not supported"):
        strategy.reduce(mine, reduce_op="median")
    assert torch.equal(strategy.all_gather(mine), stacked)
    assert strategy.broadcast({"from": hvd.rank()}, src=hvd.size() - 1) == {"from": hvd.size() - 1}
    strategy.barrier("here")
    assert strategy.reduce_boolean_decision(hvd.rank() == 0) is (hvd.size() == 1)
    assert strategy.reduce_boolean_decision(hvd.rank() == 0, all=False) is True


def test_unknown_optimizer_argument_and_late_algorithm_are_refused():
    with pytest.raises(TypeError, match="backward_passes_per_step"):
        AiakStrategy(backward_passes_per_step=2)
    with pytest.raises(TypeError, match="compresion"):
        AiakStrategy(compresion=hvd.Compression.fp16)
    # hvd.init() already ran (the session fixture) with the default algorithm.
    with pytest.raises(RuntimeError, match="already ran"):
        start_runtime("hier_staged")


# ---------------------------------------------------------------- training
def test_fit_equals_the_plain_distributed_optimizer_loop_and_shards_the_data():
    module = make_module(pl)
    trainer(epochs=2).fit(module, loader(data()))
    assert torch.equal(weights(module), plain_loop(epochs=2))
    assert same_on_every_rank(weights(module))
    # The distributed sampler: each epoch, the ranks saw disjoint halves covering the set.
    first_epoch = hvd.allgather_object(module.seen[:SAMPLES // hvd.size()])
    assert sorted(i for seen in first_epoch for i in seen) == list(range(SAMPLES))
    assert module.trainer.global_step == 2 * SAMPLES // hvd.size() // BATCH


def test_accumulated_batches_are_reduced_once_per_step():
    module = make_module(pl)
    trainer(epochs=1, accumulate_grad_batches=2).fit(module, loader(data()))
    assert torch.equal(weights(module), plain_loop(epochs=1, accumulate=2))


def test_gradient_clipping_sees_averaged_gradients():
    module = make_module(pl)
    trainer(epochs=1, gradient_clip_val=0.05).fit(module, loader(data()))
    assert torch.equal(weights(module), plain_loop(epochs=1, clip=0.05))


def test_overlap_update_overlaps_every_step_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("AIAK_OVERLAP_MIN_BUCKET_BYTES", "0")
    module = make_module(pl)
    fit = trainer(epochs=1, strategy=AiakStrategy(package="lightning.pytorch",
                                                  overlap_update=True))
    fit.fit(module, loader(data()))
    stats = fit.strategy.optimizers[0].overlap_stats()
    assert stats["overlapped_steps"] == SAMPLES // hvd.size() // BATCH, stats
    assert stats["fallback_steps"] == {}, stats
    assert torch.equal(weights(module), plain_loop(epochs=1))


def test_dgc_compression_reaches_the_optimizer():
    module = make_module(pl)
    from aiak_training.dgc.optimizer import _DGCDistributedOptimizer
    dgc = hvd.Compression.dgc(density=0.25, min_numel=16, warmup_densities=())
    strategy = AiakStrategy(package="lightning.pytorch", compression=dgc)
    trainer(epochs=1, strategy=strategy).fit(module, loader(data()))
    assert isinstance(strategy.optimizers[0], _DGCDistributedOptimizer)
    assert same_on_every_rank(weights(module))


def test_sharded_state_and_fused_optimizer_train_like_the_plain_loop():
    from aiak_training.fused_optim import FusedSGD
    sharded = make_module(pl)
    strategy = AiakStrategy(package="lightning.pytorch", shard_optimizer_state=True)
    trainer(epochs=1, strategy=strategy).fit(sharded, loader(data()))
    assert getattr(strategy.optimizers[0], "_aiak_sharded", False)

    fused = make_module(pl)
    fused.configure_optimizers = lambda: FusedSGD(fused.parameters(), lr=LR, momentum=0.9)
    fit = trainer(epochs=1)
    fit.fit(fused, loader(data()))
    assert isinstance(fit.strategy.optimizers[0], FusedSGD)
    reference = plain_loop(epochs=1)
    for module in (sharded, fused):
        assert same_on_every_rank(weights(module))
        assert torch.allclose(weights(module), reference, rtol=0, atol=1e-6)


def test_pytorch_lightning_package_trains_the_same():
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    module = make_module(pytorch_lightning)
    strategy = AiakStrategy(package="pytorch_lightning")
    assert isinstance(strategy, pytorch_lightning.strategies.ParallelStrategy)
    assert strategy_class("pytorch_lightning") is not strategy_class("lightning.pytorch")
    trainer(pytorch_lightning, epochs=1, strategy=strategy).fit(module, loader(data()))
    assert torch.equal(weights(module), plain_loop(epochs=1))


def test_lr_scheduler_drives_the_wrapped_optimizer_without_an_order_warning():
    class Scheduled(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net(0)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            return {"optimizer": optimizer,
                    "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    fit = trainer(epochs=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(Scheduled(), loader(data()))
    assert fit.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 0.5 ** 3)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


# ---------------------------------------------------------------- metrics
def test_validation_metrics_are_reduced_over_the_ranks():
    torchmetrics = pytest.importorskip("torchmetrics")

    class Scored(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net(0)
            self.label_sum = torchmetrics.SumMetric()
            self.accuracy = torchmetrics.classification.MulticlassAccuracy(
                num_classes=CLASSES, average="micro")

        def validation_step(self, batch, batch_idx):
            x, y, idx = batch
            self.log("index_sum", idx.sum().float(), reduce_fx="sum", sync_dist=True)
            self.log("index_mean", idx.float().mean(), sync_dist=True)
            self.label_sum.update(y.float())
            self.log("label_sum", self.label_sum)
            self.accuracy.update(self.net(x).argmax(1), y)
            self.log("accuracy", self.accuracy)

    module = Scored()
    result = trainer().validate(module, DataLoader(data(), batch_size=BATCH), verbose=False)[0]
    # Whole-set values, computed here without any communication.
    _, y, idx = data().tensors
    with torch.no_grad():
        correct = (module.net(data().tensors[0]).argmax(1) == y).float().mean().item()
    assert result["index_sum"] == idx.sum().item()
    assert result["index_mean"] == pytest.approx(idx.float().mean().item())
    assert result["label_sum"] == y.sum().item()
    assert result["accuracy"] == pytest.approx(correct)


# ---------------------------------------------------------------- checkpoints
def test_checkpoint_written_by_rank0_and_resume_continues_exactly():
    shared = os.environ["AIAK_TEST_TMPDIR"]
    from lightning.fabric.plugins import TorchCheckpointIO

    class CountingIO(TorchCheckpointIO):
        saves = 0

        def save_checkpoint(self, *args, **kwargs):
            CountingIO.saves += 1
            super().save_checkpoint(*args, **kwargs)

    path = os.path.join(shared, "two_epochs.ckpt")
    first = make_module(pl)
    fit = trainer(epochs=2, strategy=AiakStrategy(package="lightning.pytorch",
                                                     checkpoint_io=CountingIO()))
    fit.fit(first, loader(data()))
    fit.save_checkpoint(path)
    assert hvd.allgather_object(CountingIO.saves) == [1] + [0] * (hvd.size() - 1)
    assert os.path.exists(path)

    resumed = make_module(pl, seed=5)  # other weights: the checkpoint must replace them
    trainer(epochs=4).fit(resumed, loader(data()), ckpt_path=path)
    assert resumed.started_at_step == 2 * SAMPLES // hvd.size() // BATCH
    # The samples of epochs 3 and 4 only, and the weights of an uninterrupted run.
    assert len(resumed.seen) == 2 * SAMPLES // hvd.size()
    assert torch.equal(weights(resumed), plain_loop(epochs=4))
