"""Lightning 2 on aiak-training: ``Trainer(strategy=AiakStrategy(...))``.

Lightning 2 dropped the Horovod strategy of 1.x.  This one trains with aiak-training's
``DistributedOptimizer`` in ranks started by ``aiakrun`` or ``mpirun`` (or Ray, Spark)::

    import lightning.pytorch as pl          # or: import pytorch_lightning as pl
    from aiak_training.lightning import AiakStrategy

    trainer = pl.Trainer(strategy=AiakStrategy(), accelerator="cpu", devices=1, max_epochs=5)
    trainer.fit(model, datamodule)

    aiakrun -np 4 python train.py

Rank, world size, local rank and node come from the runtime; the distributed sampler shards
the data; ``self.log(..., sync_dist=True)``, ``all_gather``, barriers and broadcasts go through
the runtime, and torchmetrics metrics in the module combine every rank's state; checkpoints
are written by rank 0.  Keyword arguments other than ``allreduce_algorithm``, ``accelerator``,
``checkpoint_io`` and ``precision_plugin`` go to ``DistributedOptimizer`` (``compression``,
``overlap_update``, ``op``, ``groups``, ``shard_optimizer_state``, ...).  Install with
``pip install 'aiak-training[lightning]'``.  docs/lightning.md has the details.
"""
from __future__ import annotations

from typing import Any, Optional

from aiak_training.lightning._packages import choose


def strategy_class(package: Optional[str] = None) -> type:
    """The strategy class for ``package`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``; by default the one the process imported)."""
    from aiak_training.lightning.strategy import build
    return build(choose(package))


def AiakStrategy(*, package: Optional[str] = None, allreduce_algorithm: Optional[str] = None,
                 **kwargs: Any) -> Any:
    """A Lightning strategy that trains with aiak-training's ``DistributedOptimizer``.

    Arguments:
        package: ``"lightning.pytorch"`` or ``"pytorch_lightning"``: the package whose
            ``Trainer`` gets the strategy.  Default: the one this process has imported.
        allreduce_algorithm: ``AIAK_ALLREDUCE_ALGO`` for this job (``"hierarchical"``,
            ``"flat"``, ...); it must be set before the runtime starts, so pass it before
            anything calls ``hvd.init()``.  Default: the variable's value (``auto``).
        **kwargs: ``accelerator``, ``checkpoint_io`` and ``precision_plugin`` as for any
            Lightning strategy; the rest go to every ``DistributedOptimizer`` the strategy
            makes: ``compression`` (``Compression.fp16``, ``Compression.dgc(...)``),
            ``overlap_update``, ``op`` (``Average``, ``Adasum``), ``groups``,
            ``gradient_predivide_factor``, ``sparse_as_dense``, ``shard_optimizer_state``,
            ``process_set``.
    """
    return strategy_class(package)(allreduce_algorithm=allreduce_algorithm, **kwargs)


__all__ = ["AiakStrategy", "strategy_class"]
