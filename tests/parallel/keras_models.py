"""Data and model shared by the per-rank Keras tests (test_keras.py on Keras 3, test_keras2.py
on Keras 2): the same regression problem and MLP, built with whichever Keras module a test
passes, so that both suites check the same numbers."""
from types import ModuleType
from typing import Any, Optional, Tuple

import numpy as np

SAMPLES = 64


def dataset(seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(SAMPLES, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 1)) + 0.1 * rng.normal(size=(SAMPLES, 1))).astype(np.float32)
    return x, y


def make_model(keras: ModuleType, seed: int = 0, name: Optional[str] = None) -> Any:
    """A small MLP of ``keras`` whose weights are drawn from numpy (the same on every rank for
    one seed), so no backend seeding is needed."""
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(1)], name=name)
    rng = np.random.default_rng(100 + seed)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype(np.float32)
                       for w in model.get_weights()])
    return model
