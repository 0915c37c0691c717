"""``backward_passes_per_step``: summing gradients locally and applying them every N passes.

Each call of the optimizer's ``apply`` adds its gradients to per-variable sums and counts
the pass.  The N-th pass reduces the sums over the ranks (divided by N first when
``average_aggregated_gradients``), applies them and clears the sums; the passes in between
only advance ``optimizer.iterations``, so it counts backward passes as in Horovod.

The choice between the two is a backend ``cond``: inside a TensorFlow graph it becomes a
``tf.cond``, so the collective only runs on the N-th pass, on every rank alike (they all
count the same passes).  The sums are Keras variables that the optimizer does not track:
they are not part of its saved state, so a saved model loads into the plain optimizer.
"""
from typing import Any, Callable, List, Optional, Sequence

import keras

from aiak_training.common import horovod_strings as hs

Reduce = Callable[[List[Any], List[Any]], List[Any]]


class Accumulation:
    """The running sums of one distributed optimizer."""

    def __init__(self, passes: int, average: bool, sparse_as_dense: bool, adapter: Any):
        self.passes = passes
        self.average = average
        self.sparse_as_dense = sparse_as_dense
        self.adapter = adapter
        self.sums: List[Any] = []
        self.where: dict = {}
        self.count: Optional[keras.Variable] = None

    def build(self, variables: Sequence[Any]) -> None:
        """Create a zero sum per variable (called when the optimizer is built)."""
        self.sums = [keras.Variable(initializer="zeros", shape=v.shape, dtype=v.dtype,
                                    trainable=False, name="aiak_gradient_sum")
                     for v in variables]
        self.where = {id(v): i for i, v in enumerate(variables)}
        self.count = keras.Variable(0, dtype="int32", trainable=False,
                                    name="aiak_backward_passes")

    def step(self, grads: Sequence[Any], variables: Sequence[Any], reduce: Reduce,
             apply: Callable[[List[Any]], None], iterations: Any) -> None:
        """Add ``grads`` to the sums; on the N-th pass ``apply(reduce(sums))`` and clear."""
        sums: List[Any] = []
        for grad, variable in zip(grads, variables):
            if grad is None:
                sums.append(None)
                continue
            if self.adapter.is_sparse(grad):
                if not self.sparse_as_dense:
                    raise ValueError(hs.SPARSE_WITH_BACKWARD_PASSES)
                grad = self.adapter.densify(grad)
            total = self.sums[self.where[id(variable)]]
            total.assign_add(grad)
            sums.append(total)
        self.count.assign_add(1)
        variables = list(variables)

        def update() -> None:
            values = [None if s is None else keras.ops.convert_to_tensor(s) for s in sums]
            reduced = reduce(values, variables)
            if self.average:
                reduced = [None if g is None else self.adapter.divide_gradient(g, self.passes)
                           for g in reduced]
            apply(reduced)
            # Cleared after the update: on one rank the reduction hands back the sums
            # themselves, which the update still reads.
            for total in self.sums:
                total.assign(keras.ops.zeros_like(total))
            self.count.assign(0)

        def skip() -> None:
            iterations.assign_add(1)

        keras.ops.cond(keras.ops.equal(self.count, self.passes), update, skip)
