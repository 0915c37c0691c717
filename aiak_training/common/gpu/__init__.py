"""Bindings for the GPU data path: the CUDA runtime, NCCL and our own kernel library.

Framework-agnostic, like the rest of ``common/``: everything here works on raw device
addresses and raw ``cudaStream_t`` / ``cudaEvent_t`` handles, through ``ctypes`` bindings of
libraries that CUDA builds of PyTorch already ship (the ``nvidia-*-cu12`` wheels).  Nothing
links against a framework, so one install works with every framework version.

* :mod:`.cudart`: the runtime calls we need (streams, events, copies, memory).
* :mod:`.nccl`: communicators and collectives.
* :mod:`.kernels`: the batched-copy kernel built from ``csrc/cuda``.

The executor that runs GPU collectives on these is
:mod:`aiak_training.runtime.execute.gpu_executor`; the hierarchical NCCL allreduce is
:mod:`aiak_training.allreduce.hier_nccl`.
"""
