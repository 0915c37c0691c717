"""An independent NumPy implementation of Adasum (Maleki et al., MLSys 2021), for the tests.

It follows the paper's formula and binary-tree order directly, in float64, with none of the
library's code: no vector halving, no partial dot products, no kernels.  Alongside the value
it propagates a first-order bound on how far an implementation that stores each level's
result in ``dtype`` may be from it (see :func:`adasum_pair`), so fp16/bf16 tolerances are
derived, not picked.
"""
from typing import List, Sequence, Tuple

import numpy as np

# Unit roundoff (half an ulp at 1) of each storage type.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,
                 "float64": 2.0 ** -53}
F64_U = 2.0 ** -53
F32_U = 2.0 ** -24
# Horovod's rule: below this squared norm a coefficient stays 1.
MIN_NORM_SQ = 1e-8


def coefficients(a: np.ndarray, b: np.ndarray) -> Tuple[float, float]:
    ab, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - ab / (2.0 * aa) if aa >= MIN_NORM_SQ else 1.0
    cb = 1.0 - ab / (2.0 * bb) if bb >= MIN_NORM_SQ else 1.0
    return ca, cb


def adasum_pair(a: np.ndarray, b: np.ndarray, ea: np.ndarray, eb: np.ndarray,
                dtype: str) -> Tuple[np.ndarray, np.ndarray]:
    """``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b`` and an element-wise error bound.

    ``ea``/``eb`` bound the errors already in the implementation's ``a`` and ``b``.  The new
    bound adds, to first order:

    * the rounding of the result to ``dtype``: ``u |out|``;
    * the inherited errors, scaled by the coefficients: ``|ca| ea + |cb| eb``;
    * the coefficients' own error, computed from perturbed operands and summed in another
      order: ``d(a.b) <= |ea||b| + |a||eb| + n u64 |a||b|`` and
      ``d|a|^2 <= 2|a||ea| + n u64 |a|^2`` (Cauchy-Schwarz), so
      ``dca <= (d(a.b) + |a.b|/|a|^2 d|a|^2) / (2|a|^2)``, times ``|a|`` per element;
    * the arithmetic of the scaled add: float32 for the half types (two products and a sum,
      3 u32), float64 otherwise (3 u64).
    """
    u = UNIT_ROUNDOFF[dtype]
    n = a.size
    ab, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca, cb = coefficients(a, b)
    out = ca * a + cb * b
    na, nb = np.sqrt(aa), np.sqrt(bb)
    nea, neb = float(np.linalg.norm(ea)), float(np.linalg.norm(eb))
    d_ab = nea * nb + na * neb + n * F64_U * na * nb
    d_ca = (d_ab + abs(ab) / aa * (2 * na * nea + n * F64_U * aa)) / (2 * aa) \
        if aa >= MIN_NORM_SQ else 0.0
    d_cb = (d_ab + abs(ab) / bb * (2 * nb * neb + n * F64_U * bb)) / (2 * bb) \
        if bb >= MIN_NORM_SQ else 0.0
    arith_u = 3 * F32_U if dtype in ("float16", "bfloat16") else 3 * F64_U
    err = (u * np.abs(out) + abs(ca) * ea + abs(cb) * eb + d_ca * np.abs(a) + d_cb * np.abs(b)
           + arith_u * (abs(ca) * np.abs(a) + abs(cb) * np.abs(b)))
    return out, err


def adasum_tree(vectors: Sequence[np.ndarray], dtype: str = "float64"
                ) -> Tuple[np.ndarray, np.ndarray]:
    """Adasum of ``2^k`` vectors as the paper's binary tree ((v0 v1)(v2 v3))...; returns the
    float64 value and the error bound.  The bound is doubled at the end: the first-order
    terms leave out products of errors, and the reference's own float64 rounding is of the
    same size as the implementation's in the float64 case."""
    n = len(vectors)
    assert n & (n - 1) == 0, n
    level: List[Tuple[np.ndarray, np.ndarray]] = [
        (np.asarray(v, dtype=np.float64).ravel(), np.zeros(np.size(v))) for v in vectors]
    while len(level) > 1:
        level = [adasum_pair(level[i][0], level[i + 1][0], level[i][1], level[i + 1][1], dtype)
                 for i in range(0, len(level), 2)]
    value, err = level[0]
    return value, 2.0 * err
