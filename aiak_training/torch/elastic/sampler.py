"""``ElasticSampler``: splits the samples not yet processed this epoch over the current ranks,
so that after a reset the epoch continues without repeating or skipping samples."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Set

import torch
import torch.utils.data


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)``.

    Call ``record_batch(batch_idx, batch_size)`` (or ``record_indices``) after each batch and
    keep the sampler in a ``TorchState``: at a reset the processed indices of all ranks are
    merged, and the rest of the epoch is split over the new ranks.  ``set_epoch(e)`` starts
    a new epoch (forgets the processed indices).  As with ``DistributedSampler``, each rank's
    share is padded by repeating the first indices, so that all ranks run the same number of
    batches.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: Set[int] = set()
        self._unmerged: Set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: every sample is to be processed again."""
        self.epoch = epoch
        self.processed_indices = set()
        self._unmerged = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark this rank's batch number ``batch_idx`` of the current pass as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Any) -> None:
        indices = [int(i) for i in indices]
        self.processed_indices.update(indices)
        self._unmerged.update(indices)

    def take_unmerged(self) -> Set[int]:
        """Indices recorded since the last call (``TorchState`` merges them at commits)."""
        fresh, self._unmerged = self._unmerged, set()
        return fresh

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """This rank's dataset indices of batch ``batch_idx`` of the current pass."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self._unmerged = set()
        self.reset()

    def state_dict(self) -> Dict[str, Any]:
        return dict(epoch=self.epoch, processed_indices=set(self.processed_indices))

    def reset(self) -> None:
        """Re-split the unprocessed samples over the current ``size()`` and ``rank()``."""
        from aiak_training.runtime import current
        try:
            topology = current.topology()
            self.num_replicas, self.rank = topology.size, topology.rank
        except ValueError:  # not initialized: a single process
            self.num_replicas, self.rank = 1, 0
        self.remaining_indices = [i for i in range(len(self.dataset))
                                  if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        self._split()

    def _split(self) -> None:
        indices = list(self.remaining_indices)
        if self.shuffle:
            # The same permutation on every rank: seeded by seed + epoch only.
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = [indices[i] for i in torch.randperm(len(indices), generator=generator)]
        if indices:
            while len(indices) < self.total_size:
                indices += indices[:self.total_size - len(indices)]
        self.indices = indices[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self._split()
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
