"""The compiled kernels (csrc/native) and the engine's C++ core (csrc/engine), loaded once."""
try:
    from aiak_training._native import (BadRequest, EngineCore, EngineStopped,  # noqa: F401
                                       HierNode, bf16_roundtrip, call_origin, copy_batch,
                                       copy_scaled_batch, float_repr, half_roundtrip, reduce,
                                       reduce_many, scale, set_call_origin)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "aiak_training's C++ extension is not built. Install the package with "
        "`pip install -e .` (or run `python setup.py build_ext --inplace`)."
    ) from exc
