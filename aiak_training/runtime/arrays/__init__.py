"""Collectives on numpy arrays and Python objects, shared by every frontend.

``array_ops.py`` runs the collectives, ``array_pool.py`` reuses the memory of large results,
and ``objects.py`` moves picklable objects as bytes through ``array_ops``.
"""
