"""``AiakStrategy``: Lightning 2's ``Trainer(strategy=...)`` on aiak-training.

The methods live in :class:`StrategyMethods`, which knows no Lightning class; :func:`build`
puts them in front of the installed Lightning's ``ParallelStrategy`` (and the environment
methods in front of its ``ClusterEnvironment``), once per Lightning package.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import aiak_training.torch as hvd
from aiak_training.lightning import collectives, stepping
from aiak_training.lightning._packages import modules
from aiak_training.lightning.environment import EnvironmentMethods, start_runtime

# DistributedOptimizer arguments the strategy fills in itself.
_OWN_ARGUMENTS = ("optimizer", "named_parameters", "backward_passes_per_step")


def _check_optimizer_kwargs(kwargs: Dict[str, Any]) -> None:
    accepted = set(inspect.signature(hvd.DistributedOptimizer).parameters) - set(_OWN_ARGUMENTS)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(f"AiakStrategy got {', '.join(unknown)}: not a DistributedOptimizer "
                        f"argument it passes on (those are {', '.join(sorted(accepted))}; "
                        "it sets named_parameters, and backward_passes_per_step from the "
                        "Trainer's accumulate_grad_batches)")


def _named_parameters(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      prefix: str) -> Optional[List[Tuple[str, torch.nn.Parameter]]]:
    """The module's names for ``optimizer``'s parameters (None when one has no name there:
    the optimizer then generates names)."""
    names = {id(p): name for name, p in module.named_parameters()}
    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                return None
            found.append((prefix + names[id(p)], p))
    return found


class StrategyMethods:
    """What the strategy does; see :func:`aiak_training.lightning.AiakStrategy`."""

    _pl: Any = None          # the trainer package the class was built for (build())
    _environment: type = object

    def __init__(self, allreduce_algorithm: Optional[str] = None, accelerator: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None,
                 **optimizer_kwargs: Any) -> None:
        _check_optimizer_kwargs(optimizer_kwargs)
        super().__init__(accelerator=accelerator, parallel_devices=None,
                         cluster_environment=self._environment(allreduce_algorithm),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._allreduce_algorithm = allreduce_algorithm
        self._optimizer_kwargs = optimizer_kwargs
        self._originals: Dict[int, torch.optim.Optimizer] = {}  # id(wrapper) -> its optimizer

    # ---- who and where --------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        return torch.device(devices[0].type)

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Start the runtime and tell Lightning's rank-zero utilities this process's rank."""
        start_runtime(self._allreduce_algorithm)
        from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero
        self._pl.utilities.rank_zero.rank_zero_only.rank = hvd.rank()
        utilities_rank_zero.rank = hvd.rank()

    def setup_environment(self) -> None:
        self.set_world_ranks()
        super().setup_environment()

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    # ---- model and optimizers -------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # Every rank starts from rank 0's weights (and evaluates the same model).
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        collectives.attach_metrics(self.lightning_module)

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        several = len(self.optimizers) > 1
        wrapped = []
        for i, optimizer in enumerate(self.optimizers):
            names = _named_parameters(self.lightning_module, optimizer,
                                      f"optimizer{i}." if several else "")
            wrapped.append(hvd.DistributedOptimizer(
                optimizer, named_parameters=names,
                backward_passes_per_step=trainer.accumulate_grad_batches,
                **self._optimizer_kwargs))
            self._originals[id(wrapped[-1])] = optimizer
        self.optimizers = wrapped

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        if not stepping.is_distributed(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        trainer = getattr(model, "_trainer", None)
        overlap = stepping.overlap_applies(
            optimizer, model, self._pl.LightningModule, self.precision_plugin,
            self._pl.plugins.precision.Precision,
            getattr(trainer, "gradient_clip_val", None))

        def run_plugin(target: Any, step_closure: Callable[[], Any]) -> Any:
            return self.precision_plugin.optimizer_step(target, model=model,
                                                        closure=step_closure, **kwargs)

        result = stepping.step(optimizer, closure, run_plugin, overlap, **kwargs)
        # LR schedulers hold the optimizer configure_optimizers made (its param groups are
        # the wrapper's) and check that it stepped before they do: it did, through the wrapper.
        original = self._originals.get(id(optimizer))
        if original is not None:
            original._opt_called = True
        return result

    # ---- collectives ------------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return collectives.reduce(tensor, group, reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None,
                   sync_grads: bool = False) -> torch.Tensor:
        return collectives.all_gather(tensor, group, sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src)

    def barrier(self, name: Optional[str] = None) -> None:
        collectives.barrier()


@functools.lru_cache(maxsize=None)
def build(package: str) -> type:
    """The strategy class for ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    pl, fabric = modules(package)
    environment = type("AiakEnvironment",
                       (EnvironmentMethods, fabric.plugins.environments.ClusterEnvironment),
                       {"__module__": __name__, "__doc__": EnvironmentMethods.__doc__})
    return type("AiakStrategy", (StrategyMethods, pl.strategies.ParallelStrategy),
                {"__module__": __name__, "__doc__": StrategyMethods.__doc__,
                 "_pl": pl, "_environment": environment, "strategy_name": "aiak"})
