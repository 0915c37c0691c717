"""The DGC distributed optimizer: Horovod's DistributedOptimizer with a sparse exchange.

Built by :meth:`aiak_training.dgc.DGCCompressor.make_distributed_optimizer`, which
``hvd.DistributedOptimizer(..., compression=hvd.Compression.dgc(...))`` calls.  DGC is a
reduction strategy of the one distributed-optimizer wrapper
(``aiak_training.torch.optim.wrapper``): it extends the allreduce strategy
(``aiak_training.torch.optim.allreduce``), which still reduces the dense tensors, so the
result is an instance of a subclass of the wrapped optimizer's class, as with Horovod.

Per step, for every *compressed* tensor (see :meth:`DGCCompressor.compresses`), on each rank:

1. ``g``: the local gradient; optional local clipping (threshold ``clip_norm / sqrt(N)``) and
   the group's weight decay, ``g += wd * w``.
2. Momentum correction: ``u = m * u + (1 - dampening) * g`` and ``v += u`` (Nesterov:
   ``v += g + m * u``).  ``u`` is the velocity, ``v`` the residual.  They are kept apart
   from ``optimizer.state`` (optimizers such as Adam treat a non-empty state as
   initialised), and appear in ``optimizer.state_dict()["state"]`` as each tensor's
   ``dgc_velocity`` and ``dgc_residual``.
3. Selection of the top ``ceil(density * numel)`` coordinates of ``|v|`` (sampled threshold,
   exact refinement): the compiled kernels on CPU tensors (:mod:`aiak_training.dgc._kernels`),
   torch ops on the gradient's device otherwise (:mod:`aiak_training.dgc.device_select`, all
   tensors in one batch, the counts read once per step).
4. Their values are sent and removed from ``v`` (with fp16 values the rounding error stays in
   ``v``); momentum factor masking zeroes ``u`` there too.
5. One allgather of every rank's pairs for all compressed tensors, scatter-add, then ``/ N``
   for ``op=Average``; the result becomes ``p.grad``.

The wrapped optimizer's momentum is taken over: momentum and weight decay already happened in
steps 1-2, so ``step()`` runs the wrapped optimizer with ``momentum``, ``dampening``,
``nesterov`` and ``weight_decay`` set to zero for the duration of the call (the param groups
show the user's values again afterwards).  Dense tensors (1-D, small, or other dtypes) are
allreduced as in Horovod, starting from the backward hooks, and get the same SGD momentum and
weight decay from this wrapper, with ``momentum_buffer`` in the optimizer state as in
``torch.optim.SGD``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from aiak_training.common import horovod_strings as hs
from aiak_training.runtime.sets.process_sets import global_process_set
from aiak_training.dgc import _kernels, device_select
from aiak_training.dgc import wire as wire_format
from aiak_training.dgc.exchange import PendingExchange, sparse_allgather_async
from aiak_training.torch.compression import Compression
from aiak_training.torch.mpi_ops import Average, Sum
from aiak_training.torch.optim.allreduce import _DistributedOptimizer
from aiak_training.torch.optim.wrapper import wrap

# Keys of an SGD-style param group (torch.optim.SGD, aiak_training.fused_optim.FusedSGD).
# Only such groups have their momentum taken over: other optimizers (RMSprop also has a
# "momentum" key) mean something else by it.
_SGD_KEYS = ("momentum", "dampening", "nesterov", "weight_decay")
_SUSPENDED = {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}


class _Pick(NamedTuple):
    """One compressed tensor between selection and packing: its residual ``v`` and velocity
    ``u`` (flat views), ``k`` slots, and either the compiled kernel's indices and path, or
    (for tensors that device_select selects) the momentum correction still to run:
    ``(g, w, (momentum, dampening, weight_decay, nesterov, first))``."""
    v: torch.Tensor
    u: Optional[torch.Tensor]
    k: int
    index: Optional[torch.Tensor]
    path: Optional[int]
    compensation: Optional[Tuple[torch.Tensor, Optional[torch.Tensor], Tuple]]


def _rank_cuda_device(params: List[torch.Tensor]) -> Optional[int]:
    """This rank's GPU, if any parameter is on one: the one it already used for collectives,
    else torch's current device (which scripts set to ``hvd.local_rank()``)."""
    if not any(p.device.type == "cuda" for p in params):
        return None
    from aiak_training.torch import cuda as _cuda
    used = _cuda.used_device()
    return used if used is not None else torch.cuda.current_device()


def _is_sgd_group(group: Dict[str, Any]) -> bool:
    return all(k in group for k in _SGD_KEYS)


def _to_float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


class _DGCDistributedOptimizer(_DistributedOptimizer):
    """The DGC strategy: compressed tensors go through one sparse allgather in
    ``synchronize()``, dense ones through the allreduce strategy (``super()``).  The wrapped
    optimizer is reached through ``_wrapped_step`` (see ``aiak_training.torch.optim.wrapper``)."""

    _aiak_overlap_ok = False  # its synchronize() and hooks are not the allreduce ones

    def __init__(self, params, named_parameters, config, backward_passes_per_step, op,
                 gradient_predivide_factor, process_set):
        # Set before the base __init__: it registers the backward hooks, and _make_hook needs
        # to know which tensors are compressed.
        self._dgc = config
        self._dgc_schedule = config.schedule()
        self._dgc_step = 0
        self._dgc_epoch: Optional[float] = None
        self._dgc_pending: set = set()
        self._dgc_state: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        self._dgc_stats: Dict[str, Any] = {}
        self._dgc_sent: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._dgc_headers: Dict[Any, torch.Tensor] = {}
        all_params = [p for group in params for p in group["params"]]
        # Refuse bad parameters before the base __init__ registers hooks on them.
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        names = {id(p): n for n, p in named_parameters or ()}
        rank_device = _rank_cuda_device(all_params)
        for p in all_params:
            if p.requires_grad:
                config.check_parameter(p, names.get(id(p), "<unnamed>"), rank_device)
        self._dgc_sparse_ids = {id(p) for p in all_params
                                if p.requires_grad and config.compresses(p)}
        devices = sorted({str(p.device) for p in all_params if id(p) in self._dgc_sparse_ids})
        if len(devices) > 1:
            raise ValueError(f"Compression.dgc: the compressed parameters are on {devices[0]} "
                             f"and {devices[1]}; DGC exchanges them in one buffer, so they must "
                             "all be on one device (the rank's).")
        self._dgc_defer_dense = config.clip_norm is not None and config.local_clipping
        super().__init__(params, named_parameters, Compression.none, backward_passes_per_step,
                         op, gradient_predivide_factor, None, False, process_set)
        if op not in (Average, Sum):
            raise ValueError("DGC supports op=Average and op=Sum only.")

        # A fixed order, the same on every rank: it is the order of the tensors in the packed
        # exchange buffer and of the sampling seeds.
        by_name = lambda p: self._parameter_names.get(p)  # noqa: E731
        trainable = [p for group in self.param_groups for p in group["params"]
                     if p.requires_grad]
        self._dgc_sparse = sorted((p for p in trainable if id(p) in self._dgc_sparse_ids),
                                  key=by_name)
        self._dgc_dense = sorted((p for p in trainable if id(p) not in self._dgc_sparse_ids),
                                 key=by_name)
        # The base synchronize() handles the dense tensors; the compressed ones are ours.
        for p in self._dgc_sparse:
            self._requires_update.discard(p)
        self._dgc_group_of = {p: group for group in self.param_groups for p in group["params"]}
        self._dgc_name = f"dgc.{self._parameter_names.get(self._dgc_sparse[0])}" \
            if self._dgc_sparse else "dgc"
        for group in self.param_groups:
            if _is_sgd_group(group):
                if group.get("maximize", False):
                    raise ValueError("DGC does not support SGD(maximize=True).")
            elif any(id(p) in self._dgc_sparse_ids for p in group["params"]):
                _kernels.warn_once(
                    "dgc-not-sgd",
                    f"DGC: {type(self).__name__} is not SGD-like, so DGC cannot take over its "
                    "momentum; compressed tensors get local accumulation (error feedback) "
                    "without momentum correction, and the optimizer runs unchanged.")
        if not _kernels.native_available() and any(p.device.type == "cpu"
                                                    for p in self._dgc_sparse):
            _kernels.warn_once(
                "dgc-native",
                "aiak_training.dgc._dgc_cpu is not built (python setup.py build_ext --inplace); "
                "DGC selects with torch ops on CPU tensors instead: the same selections, "
                f"slower ({_kernels.IMPORT_ERROR}).")

    # ---- hooks --------------------------------------------------------------------------
    def _make_hook(self, p):
        if id(p) not in self._dgc_sparse_ids and not self._dgc_defer_dense:
            return super()._make_hook(p)

        def hook(*ignore):
            # Compressed tensors are exchanged together, in synchronize(); with local clipping
            # the dense ones wait there too, since the clip factor needs the whole gradient.
            self._passes.refuse_extra(p)
            assert not p.grad.requires_grad
            self._passes.count(p)
            self._dgc_pending.add(p)
        return hook

    # ---- hyper-parameters ---------------------------------------------------------------
    def _dgc_hyper(self, p) -> Tuple[float, float, bool, float]:
        """(momentum, dampening, nesterov, weight_decay) that DGC applies for ``p``."""
        group = self._dgc_group_of[p]
        if not _is_sgd_group(group):
            return 0.0, 0.0, False, 0.0
        return (_to_float(group["momentum"]), _to_float(group["dampening"]),
                bool(group["nesterov"]), _to_float(group["weight_decay"]))

    def set_epoch(self, epoch: float) -> None:
        """Tell DGC the current epoch (fractions allowed), for an epoch-based warm-up
        without ``steps_per_epoch``.  Call it on every rank, e.g. next to
        ``sampler.set_epoch(epoch)``."""
        self._dgc_epoch = float(epoch)

    def dgc_density(self) -> float:
        """The density the next exchange will use."""
        return self._dgc_schedule(self._dgc_step, self._dgc_epoch)

    def dgc_stats(self) -> Dict[str, Any]:
        """Figures of the last exchange: ``density``, ``selected`` (pairs this rank sent),
        ``compressed_elements``, ``sparse_bytes`` (this rank's packed segment),
        ``dense_bytes`` (payload of the dense allreduces), ``paths`` (selection path counts,
        see ``_kernels.select_topk``) and ``step``."""
        return dict(self._dgc_stats)

    def dgc_state(self, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        """DGC's live state of parameter ``p``: ``dgc_residual`` (and ``dgc_velocity`` with
        momentum), shaped like ``p``; empty before the first step."""
        return self._dgc_state.get(p, {})

    def dgc_sent(self) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
        """This rank's pairs of the last exchange: ``(name, int32 indices, values)`` per
        compressed tensor, in exchange order (values in the wire dtype)."""
        return [(self._parameter_names.get(p), idx, vals)
                for p, (idx, vals) in zip(self._dgc_sparse, self._dgc_sent)]

    # ---- compression ----------------------------------------------------------------------
    def _dgc_uses_native(self, p) -> bool:
        """CPU tensors use the compiled kernels when built; every other device the torch ops
        of :mod:`aiak_training.dgc.device_select` (same selections)."""
        return p.device.type == "cpu" and _kernels.native_available()

    def _dgc_select(self, p, density: float, position: int) -> _Pick:
        """Momentum correction and the start of the selection for one tensor."""
        cfg = self._dgc
        m, dampening, nesterov, wd = self._dgc_hyper(p)
        state = self._dgc_state.setdefault(p, {})
        g = p.grad
        if g is None:
            g = torch.zeros_like(p)
        elif g.is_sparse:
            g = g.to_dense()
        g = g.detach().reshape(-1)  # a view when contiguous
        residual = state.get("dgc_residual")
        if residual is None:
            residual = state["dgc_residual"] = torch.zeros_like(
                p, memory_format=torch.contiguous_format)
        v = residual.view(-1)
        u = None
        first = False
        if m != 0:
            velocity = state.get("dgc_velocity")
            if velocity is None:
                # A momentum buffer from dense training (a checkpoint, or the one
                # hvd.broadcast_optimizer_state creates) carries on as the velocity: it is the
                # global momentum, the same on every rank, so the ranks' velocities still
                # average to it.  Without one, as torch.optim.SGD does, the first velocity is
                # the gradient itself (no dampening).
                buf = self.state[p].pop("momentum_buffer", None) if p in self.state else None
                if buf is not None:
                    velocity = buf.detach().to(memory_format=torch.contiguous_format).clone()
                else:
                    first = True
                    velocity = torch.empty_like(p, memory_format=torch.contiguous_format)
                state["dgc_velocity"] = velocity
            u = velocity.view(-1)
        w = p.detach().reshape(-1).contiguous() if wd != 0 else None
        k = min(max(1, math.ceil(density * p.numel())), p.numel())
        seed = (cfg.seed * 1_000_003 + self._dgc_step) * 65_537 + position
        if self._dgc_uses_native(p):
            idx, path = _kernels.compensate_select(
                g.contiguous(), w, u, v, m, dampening, wd, nesterov, first, k,
                exact=cfg.exact_topk, sample_ratio=cfg.sample_ratio, seed=seed)
            return _Pick(v, u, k, idx, path, None)
        # Compensated and selected with the others, batched (see _dgc_compress_all).
        hyper = (m, dampening, wd, nesterov, first)
        return _Pick(v, u, k, None, None, (g.contiguous(), w, hyper))

    def _dgc_pairs(self, pick: _Pick, slots: torch.Tensor, count: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Take the selected values out of the residual; returns (the pairs as sent, in
        ``k`` slots: int32 indices and wire values; the wire values of the real pairs)."""
        v, u = pick.v, pick.u
        index = slots[:count].long()  # a no-op for the device path's int64 slots
        values = v.index_select(0, index)
        if self._dgc.fp16_values:
            wire = values.to(torch.float16)
            # Error feedback for the rounding, too: what fp16 could not carry stays in v.
            v.index_copy_(0, index, values - wire.to(values.dtype))
        else:
            wire = values
            v.index_fill_(0, index, 0)
        if u is not None and self._dgc.momentum_masking:
            u.index_fill_(0, index, 0)
        if count == pick.k:
            return slots.to(torch.int32), wire, wire
        # Fewer pairs than slots (fewer non-zeros than k): empty slots are sent as PAD.
        padded = torch.zeros(pick.k, dtype=wire.dtype, device=wire.device)
        padded[:count] = wire
        return slots.to(torch.int32), padded, wire

    def _dgc_compress_all(self, density: float) -> Tuple[
            List[torch.Tensor], List[torch.Tensor], List[Tuple[torch.Tensor, torch.Tensor]],
            Dict[int, int]]:
        """Select and take out every compressed tensor's pairs.  Returns, per tensor, the
        int32 indices and wire values in ``k`` slots each (what is packed), the real pairs
        (what :meth:`dgc_sent` shows), and the count of each selection path taken.

        Every selection is started before any count is read, and the counts of the tensors
        on the torch-op path are read together, once (device_select.resolve): one host
        synchronisation per step, whatever the number of tensors."""
        cfg = self._dgc
        picks = [self._dgc_select(p, density, position)
                 for position, p in enumerate(self._dgc_sparse)]
        waiting = [j for j, pick in enumerate(picks) if pick.index is None]
        # Momentum correction of the device path, foreach ops over the tensors that share
        # hyper-parameters (and velocity presence): a few launches, not a few per tensor.
        same: Dict[Any, List[_Pick]] = {}
        for j in waiting:
            g, w, hyper = picks[j].compensation
            same.setdefault((hyper, picks[j].u is None, w is None), []).append(picks[j])
        for (hyper, no_u, no_w), group in same.items():
            _kernels.compensate_many(
                [pk.compensation[0] for pk in group],
                None if no_w else [pk.compensation[1] for pk in group],
                None if no_u else [pk.u for pk in group], [pk.v for pk in group], *hyper)
        slots, counts, paths = device_select.resolve(device_select.start(
            [picks[j].v for j in waiting], [picks[j].k for j in waiting],
            exact=cfg.exact_topk, sample_ratio=cfg.sample_ratio,
            seed=cfg.seed * 1_000_003 + self._dgc_step))
        resolved = dict(zip(waiting, zip(slots, counts, paths)))
        indices, values, sent = [], [], []
        path_counts: Dict[int, int] = {}
        for j, pick in enumerate(picks):
            if pick.index is not None:
                count = int(pick.index.numel())
                slot = pick.index  # int32, ascending
                if count < pick.k:
                    slot = torch.full((pick.k,), wire_format.PAD, dtype=torch.int32)
                    slot[:count] = pick.index
                path = pick.path
            else:
                slot, count, path = resolved[j]
            idx, wire, real = self._dgc_pairs(pick, slot, count)
            indices.append(idx)
            values.append(wire)
            sent.append((idx[:count], real))
            path_counts[path] = path_counts.get(path, 0) + 1
        return indices, values, sent, path_counts

    def _dgc_header(self, indices: List[torch.Tensor]) -> torch.Tensor:
        """The segment header (the slot counts) on the tensors' device, made once per
        density: building it from a list would copy from the host and wait for the device."""
        key = (str(indices[0].device), tuple(int(i.numel()) for i in indices))
        header = self._dgc_headers.get(key)
        if header is None:
            header = torch.tensor(key[1], dtype=torch.int32, device=indices[0].device)
            self._dgc_headers = {key: header}  # the previous density's is not needed again
        return header

    def _dgc_clip_local(self, nranks: int) -> None:
        """Local gradient clipping (paper eq. 8): the threshold scaled by N^-1/2."""
        params = [p for p in self._dgc_sparse + self._dgc_dense if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_norm_(params, self._dgc.clip_norm / math.sqrt(nranks))

    # ---- synchronize / step -------------------------------------------------------------
    def synchronize(self) -> None:
        if not self.process_set.included():
            self._synchronized = True
            return
        if self._synchronized and not self._dgc_pending:
            # Already exchanged, and no backward since (step() after synchronize() without
            # skip_synchronize()).  Unlike an allreduce, compressing again is not harmless:
            # the aggregated gradient would be accumulated into the residual a second time.
            return
        nranks = self.process_set.size()
        density = self.dgc_density()
        if self._dgc_schedule.needs_epoch and self._dgc_epoch is None:
            _kernels.warn_once(
                "dgc-epoch",
                "DGC: the sparsity warm-up is measured in epochs, but optimizer.set_epoch() "
                "was not called (nor steps_per_epoch/warmup_steps given); assuming epoch 0.")
        if self._dgc_defer_dense:
            self._dgc_clip_local(nranks)

        # Compressed tensors: select and start the one allgather before waiting for anything,
        # so it overlaps with the dense allreduces still in flight.
        pending: Optional[PendingExchange] = None
        paths: Dict[int, int] = {}
        self._dgc_sent = []
        if self._dgc_sparse:
            indices, values, self._dgc_sent, paths = self._dgc_compress_all(density)
            pending = sparse_allgather_async(indices, values, name=self._dgc_name,
                                             process_set=self.process_set,
                                             header=self._dgc_header(indices))

        # Dense tensors: Horovod's own path (starts what the hooks did not, waits for all).
        super().synchronize()

        if pending is not None:
            outs = []
            for p in self._dgc_sparse:
                if p.grad is None or p.grad.is_sparse or not p.grad.is_contiguous():
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                outs.append(p.grad.view(-1))
            torch._foreach_zero_(outs)  # one launch for all of them on a GPU
            pending.finish(outs, scale=1.0 / nranks if self.op == Average else 1.0)
            for p in self._dgc_sparse:
                self._passes.rearm(p)

        if self._dgc.clip_norm is not None and not self._dgc.local_clipping:
            params = [p for p in self._dgc_sparse + self._dgc_dense if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self._dgc.clip_norm)

        self._dgc_stats = {
            "step": self._dgc_step,
            "density": density,
            "selected": sum(int(i.numel()) for i, _ in self._dgc_sent),
            "compressed_elements": sum(p.numel() for p in self._dgc_sparse),
            "sparse_bytes": pending.sent_bytes if pending is not None else 0,
            "dense_bytes": sum(p.numel() * p.element_size() for p in self._dgc_dense),
            "paths": paths,
        }
        self._dgc_pending.clear()
        self._dgc_step += 1
        self._synchronized = True

    def _dgc_dense_update_direction(self) -> Dict[torch.Tensor, torch.Tensor]:
        """Weight decay and momentum for dense tensors, as torch.optim.SGD computes them.

        Sets ``p.grad`` to the update direction and returns the original gradients, which
        ``step`` puts back after the wrapped optimizer ran.
        """
        originals = {}
        for p in self._dgc_dense:
            if p.grad is None or not _is_sgd_group(self._dgc_group_of[p]):
                continue
            m, dampening, nesterov, wd = self._dgc_hyper(p)
            d = p.grad
            if wd != 0:
                d = d.add(p.detach(), alpha=wd)
            if m != 0:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.clone(d).detach()
                else:
                    buf.mul_(m).add_(d, alpha=1 - dampening)
                d = d.add(buf, alpha=m) if nesterov else buf
            if d is not p.grad:
                originals[p] = p.grad
                p.grad = d
        return originals

    def step(self, closure=None):
        if not self.process_set.included():
            # Not part of the exchange: the wrapped optimizer runs on the local gradients,
            # with its own momentum, as Horovod's DistributedOptimizer does on such ranks.
            self._synchronized = False
            return self._wrapped_step(closure)
        self._synchronize_for_step()
        originals = self._dgc_dense_update_direction()
        # Momentum and weight decay already happened (DGC's velocity for compressed tensors,
        # the lines above for dense ones): the wrapped optimizer must not apply them again.
        suspended = []
        for group in self.param_groups:
            if _is_sgd_group(group):
                suspended.append((group, {k: group[k] for k in _SUSPENDED}))
                group.update(_SUSPENDED)
        try:
            return self._wrapped_step(closure)
        finally:
            for group, saved in suspended:
                group.update(saved)
            for p, g in originals.items():
                p.grad = g

    def zero_grad(self, *args, **kwargs):
        if self._dgc_pending:
            raise AssertionError(hs.ZERO_GRAD_RACE)
        return super().zero_grad(*args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------
    def _dgc_ordered_params(self) -> List[torch.Tensor]:
        """Parameters in the order torch numbers them in a state dict."""
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self):
        """The wrapped optimizer's state dict, with each compressed tensor's ``dgc_velocity``
        and ``dgc_residual`` added to its entry in ``"state"``, and ``"dgc": {"step",
        "epoch"}``, the warm-up position."""
        sd = super().state_dict()
        state = dict(sd["state"])
        for index, p in enumerate(self._dgc_ordered_params()):
            if self._dgc_state.get(p):
                # A new dict: torch's entry is the live self.state[p], not to be modified.
                state[index] = {**state.get(index, {}), **self._dgc_state[p]}
        sd["state"] = state
        sd["dgc"] = {"step": self._dgc_step, "epoch": self._dgc_epoch}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("dgc", None)
        state, dgc_parts = {}, {}
        for index, entry in state_dict.get("state", {}).items():
            entry = dict(entry)
            part = {k: entry.pop(k) for k in list(entry) if k.startswith("dgc_")}
            if part:
                dgc_parts[index] = part
            if entry:  # leave an entry out rather than empty: Adam & co. test len(state)
                state[index] = entry
        state_dict["state"] = state
        self._dgc_pending.clear()
        super().load_state_dict(state_dict)
        params = self._dgc_ordered_params()
        self._dgc_state = {}
        for index, part in dgc_parts.items():
            p = params[int(index)]
            self._dgc_state[p] = {k: v.to(device=p.device, dtype=p.dtype, copy=True)
                                  for k, v in part.items()}
        if extra is not None:
            self._dgc_step = int(extra["step"])
            self._dgc_epoch = None if extra["epoch"] is None else float(extra["epoch"])


def make_dgc_optimizer(optimizer: torch.optim.Optimizer, config, named_parameters=None,
                       backward_passes_per_step: int = 1, op: int = Average,
                       gradient_predivide_factor: float = 1.0,
                       process_set=global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` like ``hvd.DistributedOptimizer`` does, with DGC (``config``)."""
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op not in (Average, Sum):
        raise ValueError("DGC supports op=Average and op=Sum only.")
    return wrap(optimizer, _DGCDistributedOptimizer, named_parameters, config,
                backward_passes_per_step, op, gradient_predivide_factor, process_set)
