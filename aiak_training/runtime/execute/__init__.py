"""The lane: what the engine's thread hands to Python, run on this rank.

``executor.py`` dispatches a batch of negotiated responses; ``host_collectives.py`` moves host
memory and ``gpu_executor.py`` CUDA memory (``gpu_nccl.py``: a process set's GPU transport and
its NCCL calls; ``gpu_buffers.py``: the staging and fusion copies).  ``layouts.py`` says where
each rank's elements go, and ``completion.py`` completes the handles of a finished response.
"""
