"""The loop of the stages that train on fixed rows (SFT, reward model, DPO), on ``trainer.base.Trainer``.

One optimizer step per ``batch_size`` rows of a ``data.ShardedDataset`` in its deterministic order (the
position is the step, so resuming needs no data state), the learning-rate schedule, the non-finite
policy, evaluation every ``eval_steps`` steps and after the last. A stage says how rows become
micro-batches (``micro_batches``), the global counts that normalise its loss (``counts``), the tokens a
row holds (``row_tokens``) and which of its objective's metrics it logs each step (``step_metrics``) and
at evaluation (``eval_metrics``). Evaluation is generic: the stage's objective on the validation rows'
forward outputs (``trainer.update.Updater.evaluate``), so ``eval/loss`` is the training loss on other rows.
A stage that trains a policy (SFT, DPO) is a ``PolicyOfflineTrainer``, which also evaluates by generation
(``eval_generation``: ``trainer.policy_eval``). The reports of a stage's data readers (``reports``) name the
rows they skipped: ``trainer.base``.
"""
from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

import numpy as np

from mindrlhf.data.dataset import ShardedDataset
from mindrlhf.data.report import ConversionReport
from mindrlhf.models.layer_graphs import STATIC_VARIANTS
from mindrlhf.parallel import comm
from mindrlhf.trainer.base import Trainer
from mindrlhf.trainer.experience import bucket as round_up
from mindrlhf.trainer.memory import MicroBatchExtent
from mindrlhf.trainer.policy_eval import PolicyEvaluation
from mindrlhf.trainer.schedule import run_length
from mindrlhf.trainer.update import static_layer_graphs

log = logging.getLogger("mindrlhf")
G = TypeVar("G")


class OfflineTrainer(Trainer):
    """A stage on fixed rows (see the module docstring); ``columns`` are the training rows by name."""

    math_groups = ("optimizer", "data")

    def __init__(self, cfg, *, model, updater, tokenizer, layout, columns: Mapping[str, Sequence], source: str,
                 valid: Optional[Mapping[str, Sequence]] = None, reports: Sequence[ConversionReport] = ()):
        """``valid``: the validation rows by name (the same columns as ``columns``; None: no evaluation).
        ``reports``: the data readers' reports (train and valid file), whose skipped rows ``train`` lists in
        ``output_dir/skipped_rows.jsonl``."""
        d, p = cfg.data, cfg.parallel
        self.dataset = ShardedDataset(columns, batch_size=d.batch_size, seed=cfg.train.seed,
                                      shard_id=layout.groups.dp_rank, num_shards=p.train_dp, source=source)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # Rows per forward/backward call: a micro-batch, cut into the pipeline's micro-batches.
        self.micro_rows = cfg.micro_rows // p.train_micro_batches
        unit = f"{self.dataset.num_rows} rows, fewer than batch_size = {d.batch_size}"
        total = run_length(cfg, d.num_epochs, len(self.dataset), "num_epochs", unit)
        super().__init__(cfg, model=model, updater=updater, tokenizer=tokenizer, layout=layout, total_steps=total)
        self.valid = valid
        self.data_reports = list(reports)
        self.num_tokens = 0  # TRL's num_tokens: every real token of the rows trained on so far (``prepare`` counts)

    # -- what a stage writes ------------------------------------------------------------------------
    #: The objective's metrics (``objective.metrics``) logged each step, after loss, grad_norm and learning_rate.
    step_metrics: Tuple[str, ...] = ()
    #: The objective's metrics evaluation reports, as ``eval/<name>`` after ``eval/loss``.
    eval_metrics: Tuple[str, ...] = ()

    def micro_batches(self, batch: Dict[str, Any], split: str) -> List[Dict[str, np.ndarray]]:
        """This rank's micro-batches of ``batch`` (columns of rows of ``split``, ``"train"`` or ``"valid"``, and
        ``index``: the rows' ids in that split), with every array the objective reads."""
        raise NotImplementedError

    def counts(self, columns: Mapping[str, Sequence], rows: np.ndarray) -> Tuple[float, ...]:
        """The scalars the objective's loss is normalised by for rows ``rows`` of ``columns``: global counts,
        the same on every rank, no collective needed. Default: the number of rows (pairs for pair data)."""
        return (float(len(rows)),)

    def row_tokens(self, columns: Mapping[str, Sequence], i: int) -> int:
        """The real tokens of row ``i`` of ``columns`` that one training pass reads (TRL's ``num_tokens``)."""
        raise NotImplementedError

    def prepare(self, batch: Dict[str, Any], rows: np.ndarray) -> Tuple[List[Dict[str, np.ndarray]], Tuple[float, ...]]:
        """This rank's micro-batches of ``batch`` and the step's scalars (``counts`` of the global row ids
        ``rows``); adds the rows' real tokens to ``num_tokens``."""
        columns = self.dataset.columns
        self.num_tokens += sum(self.row_tokens(columns, i) for i in rows)
        return self.micro_batches(self.ordered(batch, columns), "train"), self.counts(columns, rows)

    def ordered(self, batch: Dict[str, Any], columns: Mapping[str, Sequence]) -> Dict[str, Any]:
        """``batch`` (rows of ``columns``, ``index`` their ids) longest first by ``row_tokens`` (stable), as
        ``data.micro_batch_order`` length asks: micro-batches are cut in this order, so like lengths pad together."""
        if self.cfg.data.micro_batch_order != "length":
            return batch
        return longest_first(batch, [self.row_tokens(columns, i) for i in batch["index"]])

    def stage_metrics(self, res: Dict[str, float], rows: np.ndarray) -> Dict[str, float]:
        """The stage's metrics of a step from the updater's result (``step_metrics``)."""
        return {k: res[k] for k in self.step_metrics}

    @property
    def has_validation(self) -> bool:
        return self.valid is not None

    def evaluate(self) -> Dict[str, float]:
        """``eval/loss`` and ``eval/<name>`` of ``eval_metrics``: the objective over every validation row
        (``Updater.evaluate``; each replica runs every dp-th row, normalised by the global ``counts``)."""
        rows = np.arange(len(next(iter(self.valid.values()))))
        mine = np.asarray(self.replica_share(rows), np.int64)
        batch: Dict[str, Any] = {k: [v[i] for i in mine] for k, v in self.valid.items()}
        batch["index"] = mine
        micro = self.micro_batches(self.ordered(batch, self.valid), "valid") if len(mine) else []
        res = self.updater.evaluate(micro, self.counts(self.valid, rows))
        return {"eval/loss": res["loss"], **{f"eval/{k}": res[k] for k in self.eval_metrics}}

    #: Whether the stage evaluates its policy by generation (``PolicyOfflineTrainer``'s ``eval_generation``).
    evaluates_policy = False

    def evaluate_policy(self) -> Dict[str, float]:
        """``eval/*`` of the policy's generations (``trainer.policy_eval``; a stage without a policy has none)."""
        return {}

    # -- the step ---------------------------------------------------------------------------------
    def train_one_step(self) -> Dict[str, float]:
        epoch, index = divmod(self.step, len(self.dataset))
        rows = self.dataset.global_indices(epoch, index)
        micro, scalars = self.prepare(self.dataset.batch(epoch, index), rows)
        lr = self.learning_rate()
        self.updater.set_lr(lr)
        res = self.updater.step(micro, scalars)
        self.count_nonfinite(res)
        self.step += 1
        out = {"loss": res["loss"], "grad_norm": res["grad_norm"], "learning_rate": lr,
               **self.stage_metrics(res, rows), "num_tokens": float(self.num_tokens),
               "epoch": self.step / len(self.dataset)}
        out.update(self.update_metrics())
        return out

    def evaluate_step(self) -> Dict[str, float]:
        """Every ``eval_steps`` steps and after the last: the validation rows' loss and, with ``eval_generation``,
        the policy's generations."""
        out: Dict[str, float] = {}
        every = self.cfg.data.eval_steps
        if (every and self.step % every == 0) or self.step == self.total_steps:
            if self.has_validation:
                out.update(self.evaluate())
            if self.evaluates_policy:
                out.update(self.evaluate_policy())
        return out

    def stage_state(self) -> Dict[str, object]:
        return {"num_tokens": self.num_tokens}

    def load_stage_state(self, state) -> None:
        self.num_tokens = int(state.get("num_tokens", 0))

    # -- helpers for evaluation -------------------------------------------------------------------
    def replica_share(self, rows: Sequence) -> List:
        """This data-parallel replica's share of ``rows`` (every dp-th row; its tp/pp ranks take the same)."""
        return list(rows[self.layout.groups.dp_rank::self.cfg.parallel.train_dp])

    def replica_sum(self, values: Sequence[float]) -> np.ndarray:
        """Sums over all replicas of per-replica ``values`` (every rank of a replica holds the same ones, so
        the world sum counts each replica tp * pp times)."""
        g = self.layout.groups
        total = comm.all_sum(np.asarray(values, np.float64).astype(np.float32)).astype(np.float64)
        return total / (g.tp * g.pp)


class PolicyOfflineTrainer(PolicyEvaluation, OfflineTrainer):
    """A stage that trains a policy on fixed rows (SFT, DPO): with ``eval_generation`` it also evaluates the policy
    by generation (``trainer.policy_eval``) whenever it evaluates, on a sampler built on the trained model at the
    first evaluation (it generates with the model itself: no copy, no weight sync)."""

    #: The column whose first row shows the prompt style the data was built with (a prompt, or a whole row).
    prompt_column = "input_ids"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sampler = None
        if self.cfg.train.eval_generation:
            from mindrlhf.data.gsm8k import prompt_style_of_ids

            self.prompt_style = prompt_style_of_ids(self.tokenizer, self.dataset.columns[self.prompt_column][0])

    @property
    def evaluates_policy(self) -> bool:
        return bool(self.cfg.train.eval_generation)

    def eval_sampler(self):
        if self._sampler is None:  # built when first needed: a run that never evaluates compiles nothing for it
            from mindrlhf.generation.factory import native_sampler

            self._sampler = native_sampler(self.model)
        return self._sampler

    def eval_replicas(self) -> Tuple[int, int, bool]:
        """The training replicas (train dp; the sampler runs on the trained policy's tp shard) share the questions."""
        return self.layout.train_dp_rank, self.layout.train.dp, self.layout.train_representative

    def eval_generation_settings(self) -> Dict[str, Any]:
        """``eval_max_new_tokens``; mindrlhf-eval's defaults for the rest (temperature 0.7, top_p 1, the
        tokenizer's stop tokens)."""
        return {"max_new_tokens": self.cfg.train.eval_max_new_tokens}


def grid_width(width: int, widths: Optional[Sequence[int]]) -> int:
    """``width`` widened to the next of ``widths`` (sorted; None or past the last: ``width`` itself)."""
    return next((w for w in widths if w >= width), width) if widths else width


def longest_first(batch: Dict[str, Any], lengths: Sequence[int]) -> Dict[str, Any]:
    """``batch`` (columns of rows: arrays or lists) with its rows reordered by ``lengths`` (one per row), longest
    first; rows of equal length keep their order."""
    order = np.argsort(-np.asarray(lengths, np.int64), kind="stable")
    return {k: v[order] if isinstance(v, np.ndarray) else [v[i] for i in order] for k, v in batch.items()}


def width_grid(widths: Sequence[int], top: int, count: int) -> Optional[List[int]]:
    """At most ``count`` micro-batch widths (prompt + completion columns) for rows whose own widths are ``widths``
    (each already a multiple of the bucket), so static-shape layer graphs (one compile per width, up to
    ``layer_graphs.STATIC_VARIANTS``) serve every micro-batch and none falls back to the slower dynamic graphs. None
    when the distinct widths with ``top`` (the widest micro-batch the layout can form) are that few already;
    otherwise the ``count`` widths ending at ``top`` that add the least padding when each row is widened to the next
    (dynamic programming over the distinct widths)."""
    counts: Dict[int, int] = {}
    for w in widths:
        counts[min(int(w), top)] = counts.get(min(int(w), top), 0) + 1
    counts.setdefault(top, 0)
    values = sorted(counts)
    if len(values) <= count:
        return None
    n = len(values)
    rows = np.cumsum([0] + [counts[v] for v in values])
    sums = np.cumsum([0] + [counts[v] * v for v in values])

    def pad(a: int, b: int) -> int:  # rows of values[a..b] widened to values[b]
        return int(values[b] * (rows[b + 1] - rows[a]) - (sums[b + 1] - sums[a]))

    # best[j][b]: least padding of values[0..b] with j widths, the last values[b]; back[j][b]: the previous width
    best = [[pad(0, b) for b in range(n)]]
    back: List[List[int]] = [[-1] * n]
    for _ in range(1, count):
        row, prev = [], []
        for b in range(n):
            options = [(best[-1][a] + pad(a + 1, b), a) for a in range(b)] or [(best[-1][b], -1)]
            cost, a = min(options)
            row.append(cost)
            prev.append(a)
        best.append(row)
        back.append(prev)
    grid, j, b = [], count - 1, n - 1
    while b >= 0:
        grid.append(values[b])
        b, j = back[j][b], j - 1
    return sorted(grid)


#: A micro-batch's (prompt, completion) widths: pairs packed behind their shared prompt run layer graphs of both.
Shape = Tuple[int, int]


def pair_lengths(prompts: Sequence[np.ndarray], chosen: Sequence[np.ndarray], rejected: Sequence[np.ndarray],
                 extra: int = 0) -> Tuple[List[int], List[int], List[int]]:
    """Each pair's prompt and longer completion as its micro-batch rows hold them (``pair_rows``; ``extra``
    columns more per completion) and its ``row_tokens`` (the prompt read twice): the inputs of ``pair_shapes``."""
    rows_p, rows_c = pair_rows(prompts, chosen, rejected)
    return ([len(p) for p in rows_p[::2]], [max(len(a), len(b)) + extra for a, b in zip(rows_c[::2], rows_c[1::2])],
            [2 * len(p) + len(c) + len(r) for p, c, r in zip(prompts, chosen, rejected)])


def pair_shapes(prompt_lengths: Sequence[int], completion_lengths: Sequence[int], order: Optional[Sequence[int]],
                step_pairs: int, micro_pairs: int, steps: int = 256, bucket: int = 32) -> Dict[Shape, int]:
    """How often each bucketed (prompt, completion) shape comes up among the micro-batches of ``micro_pairs`` pairs
    that ``steps`` random steps of ``step_pairs`` pairs form (a fixed seed): pair ``i`` has a prompt of
    ``prompt_lengths[i]`` tokens and a longer completion of ``completion_lengths[i]``; ``order``: the pairs'
    ``row_tokens``, longest first as ``OfflineTrainer.ordered`` cuts them (None: the drawn order). A sample of the
    shapes a run will see (a micro-batch is as wide as its widest pair in each part) for ``shape_grid``."""
    rng = np.random.default_rng(0)
    prompts = np.array([round_up(n, bucket) for n in prompt_lengths])
    completions = np.array([round_up(n, bucket) for n in completion_lengths])
    key = None if order is None else -np.asarray(order)
    seen: Dict[Shape, int] = {}
    for _ in range(steps):
        pick = rng.choice(len(prompts), min(step_pairs, len(prompts)), replace=False)
        if key is not None:
            pick = pick[np.argsort(key[pick], kind="stable")]
        for s in range(0, len(pick), micro_pairs):
            rows = pick[s:s + micro_pairs]
            shape = (int(prompts[rows].max()), int(completions[rows].max()))
            seen[shape] = seen.get(shape, 0) + 1
    return seen


def grid_shape(shape: Shape, grid: Optional[Sequence[Shape]], weights: Shape = (1, 2)) -> Shape:
    """``shape`` widened to the ``grid`` shape at least as wide in both parts with the fewest positions
    (``weights``: a position of each part); ``shape`` itself when none is (or no grid)."""
    wider = [g for g in grid or () if g[0] >= shape[0] and g[1] >= shape[1]]
    return min(wider, key=lambda g: weights[0] * g[0] + weights[1] * g[1]) if wider else shape


def shape_grid(shapes: Mapping[Shape, int], top: Shape, count: int, weights: Shape = (1, 2)) -> List[Shape]:
    """At most ``count`` (prompt, completion) shapes for micro-batches seen ``shapes[s]`` times each, every one
    widened to the next (``grid_shape``): greedily from ``top`` alone (the widest the rows can form, so every
    micro-batch fits one), adding the seen shape that saves the most positions (``weights``: a position of each
    part; a pair packs one prompt and two completions) while one does."""
    seen = np.array(list(shapes), np.int64).reshape(-1, 2)
    times = np.array(list(shapes.values()), np.int64)
    weight = np.asarray(weights, np.int64)

    def padding(grid: List[Shape]) -> int:
        cost = np.full(len(seen), np.iinfo(np.int64).max)
        for g in grid:  # each seen shape to its cheapest wider grid shape
            fits = (seen <= np.asarray(g)).all(axis=1)
            cost = np.where(fits, np.minimum(cost, (weight * (np.asarray(g) - seen)).sum(axis=1)), cost)
        return int((cost * times).sum())

    candidates = [(int(p), int(c)) for p, c in seen]
    grid = [(int(top[0]), int(top[1]))]
    while len(grid) < count:
        options = [(padding(grid + [s]), s) for s in candidates if s not in grid]
        if not options or min(options)[0] >= padding(grid):
            break
        grid.append(min(options)[1])
    return sorted(grid)


def pair_shape_grid(cfg, prompt_lengths: Sequence[int], completion_lengths: Sequence[int],
                    order: Sequence[int], bucket: int = 32) -> Optional[List[Shape]]:
    """The (prompt, completion) shapes a pair stage's micro-batches are padded to (``static_shape_grid``): None when
    the rows' bucketed prompt and completion widths combine into few enough shapes already, else ``shape_grid`` over
    ``pair_shapes`` sampled with the run's batch, micro-batch and ``micro_batch_order``."""
    prompts = {round_up(n, bucket) for n in prompt_lengths}
    completions = {round_up(n, bucket) for n in completion_lengths}

    def choose(count: int) -> Optional[List[Shape]]:
        if len(prompts) * len(completions) <= count:
            return None
        p = cfg.parallel  # a rank's rows of a step, and of a micro-batch, as OfflineTrainer cuts them
        seen = pair_shapes(prompt_lengths, completion_lengths, order if cfg.data.micro_batch_order == "length" else
                           None, max(cfg.data.batch_size // p.train_dp, 1),
                           max(cfg.micro_rows // p.train_micro_batches, 1), bucket=bucket)
        return shape_grid(seen, (max(prompts), max(completions)), count)

    return static_shape_grid(cfg, choose)


def static_shape_grid(cfg, choose: Callable[[int], Optional[G]]) -> Optional[G]:
    """``choose(STATIC_VARIANTS)``: the micro-batch widths of a stage whose layer graphs compile one static graph
    per input shape for that many shapes (the later ones run the slower dynamic graphs), logged once; None when the
    layer graphs are dynamic or off, or when ``choose`` needs no grid."""
    if not (cfg.parallel.layer_graphs and static_layer_graphs(cfg.parallel)):
        return None
    grid = choose(STATIC_VARIANTS)
    if grid and comm.is_main():
        log.info("micro-batch widths: %s (the rows' lengths need more than the %d static layer-graph shapes; each "
                 "micro-batch is padded to the next)", grid, STATIC_VARIANTS)
    return grid


def prompt_completion_micro_batches(prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray], size: int,
                                    pad_id: int, *, trained: Optional[Sequence[np.ndarray]] = None,
                                    segments: Optional[Sequence[np.ndarray]] = None,
                                    bucket: int = 32, widths: Optional[Sequence[int]] = None,
                                    shapes: Optional[Sequence[Shape]] = None) -> List[Dict[str, np.ndarray]]:
    """Rows ``[prompt_i | completion_i]`` cut into micro-batches of ``size`` in the log-prob head's layout:
    prompts left-padded and completions right-padded to the micro-batch's longest (each rounded up to
    ``bucket``, so compiled layer graphs see few shapes). The model reads the rows minus their last token and
    its last C positions predict the C completion columns (``completion_ids``), so the vocabulary head runs
    over completions only. ``completion_mask`` is 1 on the trained tokens: ``trained`` (per completion
    token) or every real completion token. ``segments``: each row's packed-row numbers (``pack_rows``, as
    long as prompt + completion), which become the attention mask (each packed row sees itself only).
    ``widths`` (``width_grid``): the micro-batch widths allowed; the completions are padded on to the next one.
    ``shapes`` (``shape_grid``): the (prompt, completion) widths allowed; each micro-batch is padded to the next.
    Every prompt needs at least one token (nothing predicts a first token without context)."""
    out = []
    for s in range(0, len(prompts), size):
        ps, cs = prompts[s:s + size], completions[s:s + size]
        width_p = round_up(max(len(p) for p in ps), bucket)
        width_c = round_up(max(len(c) for c in cs), bucket)
        width_p, width_c = grid_shape((width_p, width_c), shapes)
        width_c = grid_width(width_p + width_c, widths) - width_p
        ids = np.full((len(ps), width_p + width_c), pad_id, np.int32)
        real = np.zeros(ids.shape, np.int32)
        train = np.zeros((len(ps), width_c), np.float32)
        for i, (p, c) in enumerate(zip(ps, cs)):
            if not len(p):
                raise ValueError("a row with an empty prompt: its first token has no context to be predicted from")
            lo, hi = width_p - len(p), width_p + len(c)
            ids[i, lo:width_p], ids[i, width_p:hi] = p, c
            real[i, lo:hi] = 1 if segments is None else segments[s + i]
            train[i, :len(c)] = 1.0 if trained is None else trained[s + i]
        out.append({"input_ids": ids[:, :-1], "attention_mask": real[:, :-1], "completion_ids": ids[:, width_p:],
                    "completion_mask": train})
    return out


def pair_rows(prompts: Sequence[np.ndarray], chosen: Sequence[np.ndarray], rejected: Sequence[np.ndarray]
              ) -> Tuple[List[np.ndarray], List[np.ndarray]]:
    """``(prompts, completions)``: each pair as its two rows, ``chosen_i, rejected_i``. An empty prompt takes each
    completion's first token (nothing predicts a first token without context)."""
    rows_p, rows_c = [], []
    for p, c, r in zip(prompts, chosen, rejected):
        rows_p += [p, p] if len(p) else [c[:1], r[:1]]
        rows_c += [c, r] if len(p) else [c[1:], r[1:]]
    return rows_p, rows_c


def prompt_completion_extent(prompt_lengths: Sequence[int], completion_lengths: Sequence[int], rows: int,
                             bucket: int = 32) -> MicroBatchExtent:
    """The largest micro-batch ``prompt_completion_micro_batches`` can form from rows of these lengths, ``rows`` to
    a micro-batch: one holding the longest prompt and the longest completion (each padded to its own bucket, as
    there), the logits at its completion columns. ``recompute auto`` sizes the update by it, so the data's real
    lengths decide, not ``max_length``."""
    width_c = round_up(max(completion_lengths), bucket)
    return MicroBatchExtent.padded(rows, round_up(max(prompt_lengths), bucket) + width_c - 1, rows * width_c)


def pack_rows(lengths: Sequence[int], capacity: int, block: int = 1000) -> List[List[int]]:
    """Rows grouped into sequences of at most ``capacity`` tokens by best-fit decreasing, as TRL's SFT
    ``packing_strategy="bfd"`` (which packs each block of 1000 rows on its own, its ``datasets.map`` batch):
    longest row first, each into the fullest sequence it fits (the earliest such on a tie), else a new one.
    Returns each sequence's row indices in packing order; rows longer than ``capacity`` are an error (the
    readers truncate to ``max_length`` first)."""
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a row of {max(lengths)} tokens does not fit a packed sequence of {capacity}")
    bins: List[List[int]] = []
    for start in range(0, len(lengths), block):
        ids = np.arange(start, min(start + block, len(lengths)))
        order = ids[np.argsort(-np.asarray(lengths, np.int64)[ids], kind="stable")]
        free: List[Tuple[int, int, int]] = []  # (space left, when it was left, bin): sorted, best fit first
        for n, i in enumerate(order):
            size = int(lengths[i])
            at = bisect.bisect_left(free, (size, -1, -1))
            if at < len(free):
                space, _, b = free.pop(at)
            else:
                space, b = capacity, len(bins)
                bins.append([])
            bins[b].append(int(i))
            if space - size > 0:
                bisect.insort(free, (space - size, n, b))
    return bins
