"""The autotune log (``HOROVOD_AUTOTUNE_LOG``): Horovod's CSV columns, one row per sample
measured, the chosen setting last; then ``allreduce_algo``, a column of our own that names
which hierarchical scheme a ``hierarchical_allreduce=1`` row used."""
import csv
from typing import Optional

from aiak_training.runtime.autotune.knobs import MB, Setting

HEADER = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
          "cache_enabled", "cycle_time_ms", "tensor_fusion_threshold", "score",
          "allreduce_algo")


class CsvLog:
    """Appends rows as samples end, so that a job that stops early keeps what it measured."""

    def __init__(self, path: Optional[str]):
        self._file = None
        if path:
            self._file = open(path, "w", newline="")
            self._writer = csv.writer(self._file)
            self._writer.writerow(HEADER)
            self._file.flush()

    def row(self, setting: Setting, score: float) -> None:
        """One row: ``score`` is steps per second (higher is better); the fusion threshold
        is in MB, as Horovod writes it."""
        if self._file is None:
            return
        self._writer.writerow((int(setting.algorithm != "flat"), 0, 0, int(setting.cache_enabled),
                               f"{setting.cycle_time_ms:g}",
                               f"{setting.fusion_threshold / MB:g}", f"{score:.6g}",
                               setting.algorithm))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
