"""CUDA tensors for the engine: stream handles in, completion events out.

The engine's GPU path (``aiak_training.common.gpu``) takes raw ``cudaStream_t`` /
``cudaEvent_t`` handles; this module turns torch's streams into them.  A collective waits
for the producer through an event recorded on ``torch.cuda.current_stream()`` at submission,
and ``synchronize`` makes the then-current stream (and the submitting one) wait for the
result, so no host or device synchronize is needed on the hot path.
"""
from collections import Counter
from typing import Optional, Sequence, Tuple

import torch

_device: Optional[int] = None  # the one CUDA device this process uses, once seen


def check_device(tensor: torch.Tensor) -> int:
    """The CUDA device index of ``tensor``; one device per process, as in Horovod."""
    global _device
    index = tensor.device.index if tensor.device.index is not None \
        else torch.cuda.current_device()
    if _device is None:
        _device = index
    elif index != _device:
        raise ValueError(f"aiak_training uses one CUDA device per process: this process "
                         f"already used cuda:{_device}, and got a tensor on cuda:{index}. "
                         "Call torch.cuda.set_device(hvd.local_rank()) and keep tensors there.")
    return index


def used_device() -> Optional[int]:
    """The CUDA device this process has submitted tensors from, if any."""
    return _device


def ready(tensors: Sequence[torch.Tensor]) -> Tuple[int, "torch.cuda.Stream", int]:
    """(device, producer stream, ready event) for the tensors of one call: the device and
    stream are looked up once, and one event recorded on the stream serves every tensor
    (it has one use per tensor, which the engine gives back once it has waited on it)."""
    from aiak_training.common.gpu.cudart import runtime
    device = check_device(tensors[0])
    for t in tensors[1:]:
        check_device(t)
    with torch.cuda.device(device):  # a new pooled event is created on the current device
        stream = torch.cuda.current_stream(device)
        return device, stream, runtime().record(int(stream.cuda_stream), uses=len(tensors))


def consume(device: int, events: Sequence[int],
            submitted_on: Optional["torch.cuda.Stream"]) -> None:
    """Make the current stream on ``device`` wait for the completion events of a call's
    tensors, then give each back.  Tensors of one fused response share an event, so each
    distinct event is waited on once.

    The stream the op was submitted from waits too: the inputs were allocated there, and
    once the caller drops them the caching allocator may hand their memory to that stream's
    next kernels, which must not run before the engine has finished reading it.
    """
    uses = Counter(events)
    uses.pop(0, None)
    if not uses:
        return
    from aiak_training.common.gpu.cudart import runtime
    rt = runtime()
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        waiting = [int(current.cuda_stream)]
        if submitted_on is not None and submitted_on != current:
            waiting.append(int(submitted_on.cuda_stream))
        for event in uses:
            for stream in waiting:
                rt.wait_event(stream, event)
    for event, n in uses.items():
        rt.event_put(event, n)


def give_back(event: int, uses: int) -> None:
    """Return the uses of a ready event whose call was refused (the engine took none)."""
    from aiak_training.common.gpu.cudart import runtime
    runtime().event_put(event, uses)


def event_done(event: int) -> bool:
    from aiak_training.common.gpu.cudart import runtime
    return not event or runtime().event_done(event)


def empty_on_stream(shape, dtype: torch.dtype, stream: "torch.cuda.Stream") -> torch.Tensor:
    """An output allocated, from the engine thread, on the submitting stream: the caching
    allocator ties a block to the stream that allocates it."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        return torch.empty(tuple(shape), dtype=dtype, device=stream.device)
