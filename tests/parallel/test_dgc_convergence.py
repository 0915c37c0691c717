"""DGC convergence on scikit-learn's digits data (per-rank; the driver runs it on 4 ranks).

The training (benchmarks/jobs/dgc_digits.py, shared with benchmarks/dgc_bench.py's plot mode)
uses the same MLP, global batch, epochs, learning-rate schedule and seeds for every variant:
``dense`` (momentum SGD through ``hvd.DistributedOptimizer``), ``dgc`` (the same with DGC at
density 0.001 after the paper's warm-up) and ``topk_no_ef`` (top-k at the same densities
without error feedback), which must fail the accuracy bound: that shows the bound can detect
a broken residual path.

Acceptance (research notes, dgc.md section 6.3): DGC's mean test accuracy over the seeds is
within 1.0 point of dense; ``topk_no_ef`` is not.
"""
from typing import Dict, List

import numpy as np
import pytest
import torch

import aiak_training.torch as hvd
from dgc_digits import SEEDS, VARIANTS, train_digits

TOLERANCE = 1.0  # accuracy points


@pytest.fixture(scope="module")
def results() -> Dict[str, List[float]]:
    torch.set_num_threads(1)
    curves = train_digits()
    out = {}
    for variant in VARIANTS:
        out[variant] = [curves[variant][s][-1] for s in SEEDS]
        if hvd.rank() == 0:
            print(f"\nDIGITS {variant}: mean {np.mean(out[variant]):.2f} "
                  f"per seed {[round(a, 2) for a in out[variant]]}")
    return out


def test_dgc_within_one_point_of_dense(results):
    gap = np.mean(results["dense"]) - np.mean(results["dgc"])
    assert gap <= TOLERANCE, results


def test_topk_without_error_feedback_fails_the_bound(results):
    # "Clearly outside": at least twice the tolerance below dense.
    gap = np.mean(results["dense"]) - np.mean(results["topk_no_ef"])
    assert gap > 2 * TOLERANCE, results


def test_ranks_agree_on_results(results):
    gathered = hvd.allgather_object(results)
    assert all(g == gathered[0] for g in gathered)
