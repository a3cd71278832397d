"""Deterministic, resumable, shardable datasets: ``ShardedDataset`` (any named columns, held in memory)
and ``PromptDataset`` (the prompt mindrecord of ``rlhf_data.py``, or the prompt rows of a JSONL file). Every
stage's data reads through them.

Batch order is a pure function of ``(seed, epoch, step)``: each epoch shuffles all rows with a
numpy Generator seeded by ``(seed, epoch)``; global batch ``k`` is ``perm[k*B:(k+1)*B]`` and data
parallel shard ``r`` of ``N`` takes the contiguous slice ``[r*B/N, (r+1)*B/N)`` of it. So the global
batch does not depend on ``N``, and resuming at ``(epoch, step)`` recomputes the position directly
instead of replaying the stream.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from mindrlhf.errors import MindRLHFError

if TYPE_CHECKING:  # annotations only
    from mindrlhf.data.report import ConversionReport
    from mindrlhf.data.text_rows import PromptRows


class ShardedDataset:
    """Rows held in memory as named columns (numpy arrays or lists, one entry per row).

    ``batch_size`` is the GLOBAL number of rows per step (all shards together); it must be divisible
    by ``num_shards``. With ``drop_last=False`` the last, shorter batch of an epoch is kept and split
    across shards as evenly as possible (shard sizes may then differ by one). ``source`` names the data
    in errors.
    """

    def __init__(self, columns: Mapping[str, Sequence], batch_size: int, seed: int = 0, shard_id: int = 0,
                 num_shards: int = 1, drop_last: bool = True, source: str = "dataset") -> None:
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise MindRLHFError(f"shard_id {shard_id} is outside [0, num_shards={num_shards}); "
                                "pass 0 <= shard_id < num_shards")
        if batch_size < 1 or batch_size % num_shards:
            raise MindRLHFError(
                f"global batch_size {batch_size} is not a positive multiple of num_shards {num_shards}; "
                "choose a batch size divisible by the number of data-parallel shards"
            )
        sizes = {name: len(values) for name, values in columns.items()}
        if not sizes or len(set(sizes.values())) != 1:
            raise MindRLHFError(f"{source}: columns of different lengths {sizes}; every column needs one entry per row")
        self.columns = dict(columns)
        self.path = source
        self.batch_size = batch_size
        self.seed = seed
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.drop_last = drop_last
        self._perm: Tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))
        if drop_last and self.num_rows < batch_size:
            raise MindRLHFError(f"{source} has {self.num_rows} rows, fewer than batch_size {batch_size}; lower the "
                                f"batch size")

    @property
    def num_rows(self) -> int:
        """Rows in the dataset."""
        return len(next(iter(self.columns.values())))

    def __len__(self) -> int:
        """Steps (global batches) per epoch."""
        full, rest = divmod(self.num_rows, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def permutation(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch`` (the same on every shard)."""
        if self._perm[0] != epoch:  # consecutive steps share the epoch: shuffle once per epoch
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_rows))
        return self._perm[1]

    def global_indices(self, epoch: int, step: int) -> np.ndarray:
        """Row ids of global batch ``step`` of ``epoch`` (all shards)."""
        if epoch < 0 or not 0 <= step < len(self):
            raise MindRLHFError(f"(epoch {epoch}, step {step}) is out of range; steps per epoch are 0..{len(self) - 1}")
        return self.permutation(epoch)[step * self.batch_size:(step + 1) * self.batch_size]

    @staticmethod
    def shard_rows(size: int, shard: int, shards: int) -> range:
        """Row positions ``shard`` of ``shards`` holds of a global batch of ``size`` rows (contiguous; sizes may
        differ by one when ``shards`` does not divide ``size``)."""
        return range(shard * size // shards, (shard + 1) * size // shards)

    def batch(self, epoch: int, step: int) -> Dict[str, Any]:
        """This shard's part of global batch ``step`` of ``epoch``: every column's rows (arrays indexed,
        lists as lists) and ``index`` (b,) int64, the row ids."""
        rows = self.global_indices(epoch, step)
        mine = self.shard_rows(len(rows), self.shard_id, self.num_shards)
        index = rows[mine.start:mine.stop]
        out: Dict[str, Any] = {name: values[index] if isinstance(values, np.ndarray) else [values[i] for i in index]
                               for name, values in self.columns.items()}
        out["index"] = index.astype(np.int64)
        return out

    def nth_batch(self, k: int) -> Dict[str, Any]:
        """This shard's part of the ``k``-th global batch (0-based) of a pass over epochs 0, 1, … in order."""
        if k < 0:
            raise MindRLHFError(f"batch number {k} is negative; batches are counted from 0")
        epoch, step = divmod(k, len(self))
        return self.batch(epoch, step)

    def iter_from(self, epoch: int = 0, step: int = 0) -> Iterator[Tuple[int, int, Dict[str, Any]]]:
        """Yield ``(epoch, step, batch)`` from the given position on, across epochs, forever."""
        self.global_indices(epoch, step)  # validate the start before the first yield
        while True:
            while step < len(self):
                yield epoch, step, self.batch(epoch, step)
                step += 1
            epoch, step = epoch + 1, 0


class PromptDataset(ShardedDataset):
    """Prompts held in memory: a mindrecord written by ``mindrlhf.data.rlhf_data`` (``PromptDataset(path, ...)``)
    or the rows of a prompt JSONL file (``from_rows``). A batch's keys: ``prompt_ids`` (b, L) int32,
    ``prompt_length`` (b,) int32, ``solution`` (the reference answers, a list), ``index`` (b,) int64 row ids,
    and the reward functions' dataset columns under the keys ``reward_columns`` names (a mindrecord's:
    ``question``)."""

    def __init__(self, path: Union[str, os.PathLike], batch_size: int, seed: int = 0, shard_id: int = 0,
                 num_shards: int = 1, drop_last: bool = True) -> None:
        prompt_ids, prompt_length, solution, question = self._load(str(path))
        #: reward-function argument name -> the batch key holding it
        self.reward_columns: Dict[str, str] = {"question": "question"}
        #: what the reader of a prompt JSONL file read and skipped (None for a mindrecord: its converter reported)
        self.report: Optional["ConversionReport"] = None
        super().__init__({"prompt_ids": prompt_ids, "prompt_length": prompt_length, "solution": solution,
                          "question": question}, batch_size, seed, shard_id, num_shards, drop_last, source=str(path))

    @classmethod
    def from_rows(cls, rows: "PromptRows", *, max_prompt_length: int, pad_id: int, batch_size: int, seed: int = 0,
                  shard_id: int = 0, num_shards: int = 1, drop_last: bool = True,
                  report: Optional["ConversionReport"] = None) -> "PromptDataset":
        """The prompts of ``text_rows.read_prompt_rows``, padded with ``pad_id`` to ``max_prompt_length`` as the
        mindrecord converter pads them (so the same rows give the same batches either way); ``report``: the
        reader's (kept as ``self.report``, naming the rows it skipped)."""
        ids = np.full((len(rows), max_prompt_length), pad_id, dtype=np.int32)
        for i, row in enumerate(rows.prompt_ids):
            ids[i, :len(row)] = row
        lengths = np.array([len(row) for row in rows.prompt_ids], dtype=np.int32)
        dataset = cls.__new__(cls)
        dataset.report = report
        # The columns live under "column/<name>": a row's key may be any name (index, prompt_ids, ...).
        dataset.reward_columns = {name: f"column/{name}" for name in rows.columns}
        ShardedDataset.__init__(dataset, {"prompt_ids": ids, "prompt_length": lengths, "solution": list(rows.solutions),
                                          **{key: rows.columns[name] for name, key in dataset.reward_columns.items()}},
                                batch_size, seed, shard_id, num_shards, drop_last, source=rows.source)
        return dataset

    prompt_ids = property(lambda self: self.columns["prompt_ids"])
    prompt_length = property(lambda self: self.columns["prompt_length"])
    solution = property(lambda self: self.columns["solution"])
    question = property(lambda self: self.columns[self.reward_columns["question"]])

    @property
    def max_prompt_length(self) -> int:
        """Padded prompt length ``L`` of ``prompt_ids``."""
        return int(self.prompt_ids.shape[1])

    @staticmethod
    def _load(path: str) -> Tuple[np.ndarray, np.ndarray, List[str], List[str]]:
        if not os.path.isfile(path):
            raise MindRLHFError(f"prompt mindrecord not found: {path}; "
                                "create it with python -m mindrlhf.data.rlhf_data")
        if not os.path.isfile(path + ".db"):
            raise MindRLHFError(f"{path}.db (the mindrecord index) is missing; keep it next to {path} "
                                "or re-run the converter")
        from mindspore.mindrecord import FileReader  # lazy: importing mindspore takes seconds

        # One consumer keeps the rows in file order, so a row id is its position in the file.
        reader = FileReader(path, num_consumer=1, columns=["prompt_ids", "prompt_length", "solution", "question"])
        try:
            rows = list(reader.get_next())
        finally:
            reader.close()
        if not rows:
            raise MindRLHFError(f"{path} holds no rows; re-run the converter on a non-empty dataset")
        prompt_ids = np.stack([np.asarray(row["prompt_ids"], dtype=np.int32) for row in rows])
        lengths = np.array([int(row["prompt_length"]) for row in rows], dtype=np.int32)
        return prompt_ids, lengths, [str(row["solution"]) for row in rows], [str(row["question"]) for row in rows]
