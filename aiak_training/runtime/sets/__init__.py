"""Process sets: the public :class:`~aiak_training.runtime.sets.process_sets.ProcessSet`
(``process_sets.py``) and the engine's record of the sets this rank runs (``set_registry.py``).
"""
