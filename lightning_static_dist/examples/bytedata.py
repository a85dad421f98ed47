"""The character model's data: byte windows of a text corpus, and a loader that resumes mid-epoch.

The corpus is read as UTF-8 *bytes* in a sorted file order, so every rank and every machine reads the same bytes;
it is cut into non-overlapping windows (:class:`ByteWindows`) so that an epoch has a well-defined length that a
``DistributedSampler`` splits evenly across ranks. The training loader keeps its place in the epoch in the checkpoint
(:class:`ResumableLoader`), so a run resumed from a mid-epoch checkpoint sees the batches the uninterrupted run would
have seen.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte tensor: sample ``i`` is ``data[i*T : i*T+T]`` and the same slice
    shifted by one byte as its target.

    Example::

        ds = ByteWindows(torch.tensor(list(b"hello world"), dtype=torch.uint8), block_size=4)
        x, y = ds[0]  # b"hell", b"ello" as int64
    """

    def __init__(self, data: Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        # the last window needs one byte past its end for the target
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"ByteWindows: index {i} out of range for {len(self)} windows")
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class ResumableSampler(DistributedSampler):
    """Lightning's own choice of sampler (a ``DistributedSampler`` of this rank's share, reshuffled every epoch from
    the run's seed), which can begin its next epoch a number of samples in: where a resumed epoch picks up.

    Example::

        sampler = ResumableSampler(ds, num_replicas=2, rank=0, seed=1234)
        sampler.set_epoch(3)
        sampler.start_at(64)   # the next iteration skips this rank's first 64 samples of epoch 3, once
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self._start = 0

    def start_at(self, samples: int) -> None:
        """Skip ``samples`` of this rank's share in the next iteration only."""
        self._start = samples

    @override
    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        # __len__ stays the whole epoch's: Lightning counts the epoch's batches before it restores the position,
        # and expects the resumed iterator to give only the batches left (it adds those done to its own count)
        return iter(list(super().__iter__())[start:])


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` whose position in the epoch is part of its state: Lightning's
    fit loop saves a loader's ``state_dict`` in every checkpoint and hands it back to ``load_state_dict`` when a fit
    resumes, before the loader's first iteration.

    The position is counted in batches the loader gave out (with ``num_workers > 0`` its workers read ahead from the
    sampler; what they read ahead was not trained on). The state holds no rank's own data, only the epoch and the
    batch: the checkpoint keeps rank 0's, and every rank resumes from it.

    Example::

        loader = ResumableLoader(ds, batch_size=8, sampler=ResumableSampler(ds, 2, 0, seed=0), drop_last=True)
        loader.load_state_dict({"epoch": 0, "batches": 5})
        next(iter(loader))  # this rank's sixth batch of epoch 0
    """

    sampler: ResumableSampler

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch, self._batches = 0, 0
        self._resume: Optional[tuple[int, int]] = None

    def state_dict(self) -> dict[str, int]:
        # the geometry too: a position in batches means the same samples only at the same world size and batch size
        return {"epoch": self._epoch, "batches": self._batches, "num_replicas": self.sampler.num_replicas,
                "batch_size": self.batch_size or 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = (state.get("num_replicas", self.sampler.num_replicas), state.get("batch_size", self.batch_size or 1))
        if saved != (self.sampler.num_replicas, self.batch_size or 1):
            if self.sampler.rank == 0 and state["batches"]:
                print(f"static_dist: resumed mid-epoch at another world size or batch size ({saved[0]} x {saved[1]}"
                      f" then, {self.sampler.num_replicas} x {self.batch_size} now): epoch {state['epoch']} starts"
                      " again from its first batch, so the run does not continue bit for bit", file=sys.stderr)
            return
        self._resume = (state["epoch"], state["batches"])

    @override
    def __iter__(self) -> Iterator[Any]:
        # a generator: its body runs at the first batch, after Lightning's set_epoch (which follows its iter())
        resume, self._resume = self._resume, None
        self._epoch, self._batches = self.sampler.epoch, 0
        # a checkpoint written as an epoch ended resumes at the next epoch's start
        if resume is not None and resume[0] == self._epoch and 0 < resume[1] < len(self):
            self._batches = resume[1]
            self.sampler.start_at(self._batches * self.batch_size)
        for batch in super().__iter__():
            self._batches += 1
            yield batch


CORPUS_SUFFIXES = (".py", ".txt", ".md")
# test suites are full of deliberately odd bytes; idlelib/lib2to3 are large and unrepresentative
SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}


def text_files(root: Path, suffixes: tuple[str, ...], skipped_dirs: set[str]) -> list[Path]:
    """The files under ``root`` ending in one of ``suffixes``, outside ``skipped_dirs``, in one order everywhere."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # prune in place so os.walk never descends into them; hidden dirs are .git, .venv and the like
        dirnames[:] = [d for d in dirnames if d not in skipped_dirs and not d.startswith(".") and d != "__pycache__"]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(suffixes))
    # sorted by path, not walk order, so every rank and every machine concatenates the same bytes
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_bytes(files: list[Path], max_bytes: int) -> bytes:
    """The first ``max_bytes`` of ``files`` joined in order (reading no file past the limit)."""
    chunks, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        chunk = f.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)[:max_bytes]
