"""Bringing every rank to the same starting point: model parameters, optimizer state and
arbitrary picklable objects (the ``horovod.torch.functions`` API).

Objects travel as cloudpickle bytes in a single allgather of uint8 tensors: contributions may
differ in length, so no rank has to learn a byte count in a separate step first.
"""
import functools
import io
import sys
from collections import Counter
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import cloudpickle
import torch

from aiak_training.common import horovod_strings as hs
from aiak_training.runtime.diagnostics.call_origin import collective_helper
from aiak_training.runtime.sets.process_sets import ProcessSet, global_process_set
from aiak_training.torch.mpi_ops import (allgather_async, broadcast_async_, rank, size,
                                         synchronize)


# ---- parameters -----------------------------------------------------------------------------
def _as_named(params: Any) -> List[Tuple[Optional[str], Any]]:
    """``(name, value)`` pairs in an order every rank agrees on: a mapping by sorted key, a
    list as given (bare tensors get no name)."""
    if isinstance(params, dict):
        return [(key, params[key]) for key in sorted(params)]
    if isinstance(params, list):
        return [entry if isinstance(entry, tuple) else (None, entry) for entry in params]
    raise ValueError(hs.INVALID_PARAMS_TYPE.format(type(params)))


@collective_helper("broadcast_parameters")
def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite tensors in place with ``root_rank``'s values.

    Arguments:
        params: a dict of tensors (``model.state_dict()``) or a list of tensors or of
            ``(name, tensor)`` pairs (``list(model.named_parameters())``).  Entries that are
            not tensors are skipped; a generator is rejected with ``ValueError``.
        root_rank: global rank whose values every rank ends up with.

    All broadcasts are started before the first is waited for.

    A collective: every rank must call it, or the others wait for it (by default the job
    then stops with a deadlock error naming this function).
    """
    gather = sys.modules.get("aiak_training.torch.optim.sharded.gather")
    if gather is not None:  # a sharded optimizer's allgather in flight would overwrite them
        gather.wait_for_all_parameters()
    handles = [broadcast_async_(value, root_rank, name)
               for name, value in _as_named(params) if torch.is_tensor(value)]
    for handle in handles:
        synchronize(handle)


# ---- optimizer state ------------------------------------------------------------------------
def _create_state(optimizer) -> None:
    """Give a fresh optimizer its per-parameter state by stepping once on zero gradients.

    The parameters are put back afterwards: a zero gradient still moves them under weight
    decay (AdamW), and these ranks' parameters were typically just made equal to the root's
    by ``broadcast_parameters``.  (Horovod leaves the decayed values, so ranks drift apart.)
    """
    sparse_grads = isinstance(optimizer, torch.optim.SparseAdam)
    saved = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not param.requires_grad:
                continue
            saved.append((param, param.detach().clone()))
            zeros = param.data.new_zeros(param.size())
            param.grad = zeros.to_sparse() if sparse_grads else zeros
    if getattr(optimizer, "_aiak_distributed", False):
        # The wrapper's step() would allreduce all these zero gradients, a collective that
        # only adds traffic (and hangs unless every member steps); creating state needs
        # just the wrapped class's step().
        optimizer._wrapped_step()
    else:
        optimizer.step()
    with torch.no_grad():
        for param, before in saved:
            param.copy_(before)


def _set_item(container: Dict, key: Hashable, value: Any) -> None:
    container[key] = value


def _partition_state(optimizer, state_dict: Dict
                     ) -> Tuple[List[Tuple[str, torch.Tensor]], Dict[Tuple, Any],
                                Dict[Tuple, Callable[[Any], None]]]:
    """Split an optimizer's state into tensors, which are broadcast in place, and plain values
    (hyperparameters such as ``lr`` or ``betas``, and non-tensor per-parameter entries),
    which travel together as one object.  Each plain value comes with the setter that
    stores the root's value back where it was read from."""
    tensors: List[Tuple[str, torch.Tensor]] = []
    values: Dict[Tuple, Any] = {}
    setters: Dict[Tuple, Callable[[Any], None]] = {}
    per_entry = Counter()
    for index, group in enumerate(state_dict["param_groups"]):
        live_group = optimizer.param_groups[index]
        for option, value in group.items():
            if option == "params":
                continue
            values[("group", index, option)] = value
            setters[("group", index, option)] = functools.partial(_set_item, live_group, option)
        for pid in group["params"]:
            # Parameters that never had a gradient (requires_grad=False) have no state.
            entries = state_dict["state"].get(pid)
            if entries is None:
                continue
            for entry, value in entries.items():
                if torch.is_tensor(value):
                    # Named by entry and how often that entry was seen: identical on all ranks.
                    per_entry[entry] += 1
                    tensors.append((f"{entry}.{per_entry[entry]}", value))
                else:
                    values[("state", pid, entry)] = value
                    setters[("state", pid, entry)] = functools.partial(_set_item, entries,
                                                                       entry)
    return tensors, values, setters


@collective_helper("broadcast_optimizer_state")
def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Make every rank's optimizer state equal to ``root_rank``'s.

    Tensor state (momentum buffers, Adam moments, ...) is overwritten in place; every other
    value, including each param group's options (``lr``, ``betas`` tuples, ...), is replaced
    by the root's copy, types preserved.  An optimizer that has no state yet is stepped once
    on zero gradients first, so that all ranks hold the same entries; parameters with
    ``requires_grad=False`` are left out.  Works on a plain optimizer or a
    ``DistributedOptimizer``.

    A collective: every rank must call it, or the others wait for it (by default the job
    then stops with a deadlock error naming this function).

    Arguments:
        optimizer: the optimizer; ``torch.optim.LBFGS`` is refused with ``ValueError``.
        root_rank: global rank whose state is copied.
        model: accepted for compatibility and ignored.  Horovod uses it to find sparse
            embeddings and hands them sparse zero gradients for the initial step; here that
            step uses dense zero gradients (sparse ones only for ``SparseAdam``), since SGD
            momentum on a sparse gradient would leave a sparse buffer, which cannot be
            broadcast.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(hs.LBFGS_STATE)
    if getattr(optimizer, "_aiak_sharded", False):
        # shard_optimizer_state=True: each shard's state exists on one rank only.
        optimizer.broadcast_options(root_rank)
        return
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        _create_state(optimizer)
        state_dict = optimizer.state_dict()
        if not state_dict["state"]:
            return  # a stateless optimizer (e.g. SGD without momentum)

    tensors, values, setters = _partition_state(optimizer, state_dict)
    broadcast_parameters(tensors, root_rank)
    for key, value in broadcast_object(values, root_rank).items():
        setters[key](value)


# ---- Python objects -------------------------------------------------------------------------
def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)


def _gather_bytes(payload: torch.Tensor, name: str, process_set: ProcessSet) -> bytes:
    """Every member's ``payload`` (any length, empty too), concatenated in rank order."""
    gathered = synchronize(allgather_async(payload, name=name, process_set=process_set))
    return gathered.numpy().tobytes()


@collective_helper("broadcast_object")
def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Send a picklable object from ``root_rank`` to every member of ``process_set``.

    A collective: every member of ``process_set`` must call it, or the others wait for it
    (by default the job then stops with a deadlock error naming this function).

    For example, to start every rank from rank 0's optimizer::

        state = hvd.broadcast_object(optimizer.state_dict(), root_rank=0)
        optimizer.load_state_dict(state)

    Arguments:
        obj: the object to send (cloudpickle is used, so lambdas and local classes work);
            only the root's value matters.
        root_rank: global rank that sends; it must belong to ``process_set``.
        name: name of the operation; by default the name of ``type(obj)``, so all ranks
            must pass objects of the same type or give a name.
        process_set: the ranks taking part; all of them by default.

    Returns:
        On the root, ``obj`` itself; elsewhere an unpickled copy of the root's ``obj``.
    """
    is_root = rank() == root_rank
    if name is None:
        name = type(obj).__name__
    # Only the root contributes bytes, so the gathered buffer is exactly its pickle.
    payload = _pickled(obj) if is_root else torch.empty(0, dtype=torch.uint8)
    data = _gather_bytes(payload, f"broadcast_object.{name}", process_set)
    if not data:
        # Every member got nothing, so all of them raise here alike.
        raise ValueError(f"broadcast_object: root_rank {root_rank} is not a member of "
                         f"{process_set}.")
    return obj if is_root else cloudpickle.loads(data)


@collective_helper("allgather_object")
def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Collect a picklable object from every rank.

    A collective: every rank must call it, or the others wait for it (by default the job
    then stops with a deadlock error naming this function).

    Arguments:
        obj: this rank's object (pickled with cloudpickle).
        name: name of the operation; by default the name of ``type(obj)``.

    Returns:
        A list of ``hvd.size()`` objects in rank order (unpickled copies, this rank's too).
    """
    if name is None:
        name = type(obj).__name__
    stream = io.BytesIO(_gather_bytes(_pickled(obj), f"allgather_object.{name}",
                                      global_process_set))
    # A pickle ends with its own STOP opcode, so the concatenated pickles are read back one
    # after the other from the same stream.
    return [cloudpickle.load(stream) for _ in range(size())]
