"""What the runtime tells the user about a job.

``startup_line.py``: the line rank 0 says at ``hvd.init()`` (what is on, and why).
``call_origin.py``: which library helper submitted a collective, for stall and deadlock
reports.  ``watchdog.py``: a collective stuck on a network fault becomes a clear, bounded
failure.
"""
