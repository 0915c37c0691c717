"""The GPU data path: CUDA tensors through NCCL, or staged through pinned host memory and MPI.

Framework-agnostic, like the rest of ``common/``: everything here works on raw device
addresses and raw ``cudaStream_t`` / ``cudaEvent_t`` handles, through ``ctypes`` bindings of
the CUDA runtime (:mod:`.cudart`) and of NCCL (:mod:`.nccl`) as shipped in the
``nvidia-*-cu12`` wheels that CUDA builds of PyTorch already depend on.  Nothing links
against a framework, so one install works with every framework version.

* :mod:`.cudart`: the few runtime calls we need (streams, events, copies, memory).
* :mod:`.nccl`: communicators and collectives.
* :mod:`.transport`: how a GPU collective moves data: ``NcclTransport`` (NCCL on the
  device) or ``StagedTransport`` (pinned host staging + the CPU engine's MPI algorithms).
* :mod:`.executor`: runs the negotiated GPU responses of one process set (fusion on the
  device, stream ordering, completion events).
* :mod:`.hier`: hierarchical allreduce on NCCL (reduce-scatter in the node, allreduce
  across nodes, allgather in the node), pipelined over chunks like ``aiak-hier``.
"""
