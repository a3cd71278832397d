"""Disaggregated rollout (``gen_workers`` K > 0): the last K ranks of the msrun world only sample, the first N only
train; what crosses between them, and the generator ranks' loop.

Every collective here spans the whole job (``comm.job_*``); everything else each side does runs in its own scope
(``comm.enter_scope``), so the trainers run the colocated training code as an N-process job. Only AllGather and
Broadcast are used, which every backend has (CPU's mccl has no Send/Receive). One step at ``max_staleness`` 0::

    generators  | sample step s (weights v = s-1) | gather ->|          idle           |<- broadcast v = s |
    trainers    |          idle (wait)            | gather ->| reward, ref, train step s|-> broadcast v = s |

At ``max_staleness`` >= 1 (one step off) the generators send step 1's rows and sample step 2's at once with the
same weights; from then on the trainers broadcast update s - 1 as soon as they hold step s's rows, and train step s
while the generators sample step s + 1 with it (the same collectives in the same order on both sides)::

    generators  | sample s+1 (v = s-1)       | gather s+1 ->|<- broadcast v = s | sample s+2 (v = s)      | ...
    trainers    | reward, ref, train step s  | gather s+1 ->|-> broadcast v = s | reward, ref, train s+1 | ...

* ``RolloutLink.start``: a Broadcast from rank 0 of where the run starts (step, batches drawn, run length) and of
  the job's clock origin, so a resumed job's generators continue at the trainers' data position; then the weights
  (one step off and resumed: the checkpoint's weights in flight, so the next step's rows are sampled again). A run
  length of 0: the trainers replay recorded rows (``replay_data_file``), the generators stop.
* ``RolloutLink.send`` / ``receive``: the step's completions as one fixed-shape padded AllGather (each generator's
  block of ``rows_per_generator`` rows: token ids, sampler log-probs, entropies and the tool mask padded to
  ``width``, the length, whether it was cut at the limit, the policy version it was sampled with, and its tool calls,
  failed calls and turns); the trainers' blocks are zeros. With ``tools`` the generators run them
  (``generation.tool_loop``), so the rows arrive with their tool results in place.
  Then each generator's busy interval and idle seconds (one small AllGather; the ``time/generator_*`` metrics).
* ``RolloutLink.more_rounds``: with DAPO's dynamic sampling (max_staleness 0), after each round a Broadcast from
  rank 0 of whether the step needs another round; the generators then sample the next batches with the round's
  seeds, as a colocated rank would.
* ``RolloutLink.push_weights`` / ``pull_weights``: the policy version, then each weight (HF names, model order) as a
  Broadcast from rank 0 (under train tp/pp first assembled from the trainers' shards by an AllReduce among the
  trainers, ``resharding.assemble``), cut to the generator's infer shard (``sharding.shard_tensor``; infer tp: its
  slice) and written by the sampler's ``load_weights``. With infer tp the tp ranks of a generator replica sample
  the same rows (the replica's seeds) and tp rank 0's block stands for them in ``receive``.
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import numpy as np

from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import Completion, Sampler
from mindrlhf.generation.tool_loop import ToolLoop
from mindrlhf.models.weights import get_weights
from mindrlhf.parallel import comm
from mindrlhf.parallel.groups import RunLayout
from mindrlhf.parallel.resharding import assemble, model_names
from mindrlhf.parallel.sharding import param_shape, shard_tensor
from mindrlhf.trainer.sampling import load_prompt_dataset, sample_batches, sampling_params
from mindrlhf.utils import faults

log = logging.getLogger(__name__)

#: Padded per-token fields of a completion row: ids, log-probs, entropies, tool mask.
_FIELDS = 4
#: Columns after them: its length, cut at the limit, version, tool calls, failed calls, turns.
_TAIL = 6


def block_columns(width: int) -> int:
    """The columns of a ``pack_completions`` row at ``width`` tokens."""
    return _FIELDS * width + _TAIL


def pack_completions(completions: List[Completion], versions: List[int], rows: int, width: int) -> np.ndarray:
    """One generator's completions as a ``(rows, 4 * width + 6)`` float32 block (token ids and counts are exact in
    float32 below 2**24): ids | log-probs | entropies | tool mask (NaN where the sampler reports no entropies, or
    the completion has no tool mask), each padded to ``width``, then length, truncated, version, tool calls, tool
    failures, turns."""
    if len(completions) != rows:
        raise MindRLHFError(f"a generator sampled {len(completions)} completions where the step needs {rows}")
    block = np.zeros((rows, block_columns(width)), np.float32)
    for i, (c, v) in enumerate(zip(completions, versions)):
        n = len(c.token_ids)
        if n > width:
            raise MindRLHFError(f"a completion of {n} tokens exceeds max_completion_length {width}")
        block[i, :n] = c.token_ids
        block[i, width:width + n] = c.logprobs
        # NaN marks a sampler that reports no entropies (vLLM): the trainer leaves the metric out, as colocated.
        block[i, 2 * width:2 * width + n] = c.entropies if len(c.entropies) == n else np.nan
        # NaN marks no tool mask (a one-turn completion: every token the policy's), which the trainer reads as [].
        block[i, 3 * width:3 * width + n] = c.tool_mask if len(c.tool_mask) == n else np.nan
        block[i, _FIELDS * width:] = (n, c.finish_reason == "length", v, c.tool_calls, c.tool_failures, c.turns)
    return block


def unpack_completions(block: np.ndarray, width: int, first_index: int = 0) -> Tuple[List[Completion], np.ndarray]:
    """The completions of a ``pack_completions`` block (``prompt_index`` counted from ``first_index``, as the
    sampler's are not needed here) and their versions."""
    out = []
    tail = _FIELDS * width
    for i, row in enumerate(block):
        n = int(row[tail])
        entropies, tool_mask = row[2 * width:2 * width + n], row[3 * width:3 * width + n]
        out.append(Completion(prompt_index=first_index + i, token_ids=[int(t) for t in row[:n]],
                              logprobs=[float(x) for x in row[width:width + n]],
                              finish_reason="length" if row[tail + 1] else "stop",
                              entropies=[] if np.isnan(entropies).any() else [float(x) for x in entropies],
                              tool_mask=[] if np.isnan(tool_mask).any() else [int(x) for x in tool_mask],
                              tool_calls=int(row[tail + 3]), tool_failures=int(row[tail + 4]),
                              turns=int(row[tail + 5])))
    return out, block[:, tail + 2].astype(np.int64)


class RolloutLink:
    """Both sides' end of the rollout and weight traffic of a disaggregated job (see the module docstring); the
    trainers and the generators call the matching methods in the same order."""

    def __init__(self, layout: RunLayout, rows_per_generator: int, width: int):
        self.layout, self.rows, self.width = layout, int(rows_per_generator), int(width)
        self.trainers = layout.train.world_size
        #: The job's clock origin (rank 0's wall clock when the run started, ``start``): every rank reports its
        #: busy intervals as seconds since it, so the two sides' intervals compare (float32 keeps 1e-4 s there).
        self.origin = time.time()

    def now(self) -> float:
        """Seconds since the job's clock origin (``start``), on this rank's wall clock."""
        return time.time() - self.origin

    @classmethod
    def of_job(cls, cfg, layout: RunLayout, batch_size: int, rollouts_per_step: int,
               num_generations: int) -> "RolloutLink":
        """The link of a job whose global batch holds ``batch_size`` prompts: each generator replica sends its
        ``batch_size / infer_dp`` prompts' ``num_generations`` completions of each of ``rollouts_per_step`` batches,
        padded to ``max_completion_length``. The trainers and the generators build it alike."""
        return cls(layout, rows_per_generator=batch_size // layout.infer.dp * rollouts_per_step * num_generations,
                   width=cfg.generation.max_completion_length)

    # -- where the run starts ----------------------------------------------------------------------------
    def start(self, step: int = 0, batches_drawn: int = 0, total_steps: int = 0,
              weights: bool = True) -> Tuple[int, int, int, bool]:
        """Rank 0's ``(step, batches_drawn, total_steps, weights)`` on every rank (the others' arguments are
        ignored); ``weights``: the policy's weights follow (``push_weights``), else the generators start from
        their own checkpoint (sft_path_infer). ``total_steps`` 0: nothing to sample (the trainers replay a recorded
        run), the generators stop."""
        # The clock origin rounded to a float32 (to 128 s, which does not matter: it is only a common zero).
        origin = float(np.float32(time.time() - 256.0))
        got = comm.job_broadcast(np.array([step, batches_drawn, total_steps, weights, origin], np.float32))
        self.origin = float(got[4])
        return int(got[0]), int(got[1]), int(got[2]), bool(got[3])

    # -- rollouts: generators -> trainers ---------------------------------------------------------------------
    def _representatives(self, gathered: np.ndarray) -> np.ndarray:
        """The generator replicas' entries of a job-wide gather, in replica order: the tp ranks of a replica
        (infer_tp > 1) sample the same rows, so tp rank 0 speaks for them."""
        infer = self.layout.infer
        return gathered[[self.trainers + r for r in range(infer.world_size) if infer.coords(r).tp == 0]]

    def _exchange(self, block: np.ndarray) -> np.ndarray:
        """Every generator replica's block, in replica order (one AllGather over the job)."""
        return self._representatives(comm.job_all_gather(block)).reshape(-1, block.shape[1])

    def send(self, completions: List[Completion], version: int, busy: Tuple[float, float, float] = (0, 0, 0)) -> None:
        """A generator's completions of the step, all sampled with policy ``version``, then ``busy``: when its
        sampling started and ended (``now``) and how long it waited before it (``GenerationWorker.train``)."""
        self._exchange(pack_completions(completions, [version] * len(completions), self.rows, self.width))
        comm.job_all_gather(np.array(busy, np.float32))

    def receive(self) -> Tuple[List[Completion], np.ndarray, np.ndarray]:
        """A trainer's: every generator's completions of the step (generator-replica order), their versions and
        each generator's ``(busy start, busy end, idle seconds)`` of them (``send``)."""
        block = self._exchange(np.zeros((self.rows, block_columns(self.width)), np.float32))
        completions, versions = unpack_completions(block, self.width)
        busy = comm.job_all_gather(np.zeros(3, np.float32))[self.trainers:]  # every generator rank's
        return completions, versions, busy

    def more_rounds(self, more: bool = False) -> bool:
        """DAPO's dynamic sampling (max_staleness 0): rank 0's word after each round of a step, whether the
        generators sample another (the trainers decide it on the round's rewards; the generators' ``more`` is
        ignored)."""
        return bool(comm.job_broadcast(np.array([more], np.float32))[0])

    # -- weights: trainers -> generators ---------------------------------------------------------------------
    def push_weights(self, policy, version: int, weights=None, keep: bool = False) -> dict:
        """The trainers' side (every trainer calls it): the policy's full weights from rank 0, or ``weights``
        (rank 0's, by HF name: a resumed run's weights in flight), and their version; returns what rank 0 sent
        (``keep``: a copy, as the policy trains on in place), ``{}`` on the other ranks. Under train tp/pp each
        tensor is first assembled from the trainers' shards (``resharding.assemble``: an AllReduce over the
        trainers' side only, as a checkpoint assembles it), one tensor in flight."""
        comm.job_broadcast(np.array([version], np.float32))
        names = model_names(policy.config)
        train = self.layout.train
        if weights is None and (train.tp > 1 or train.pp > 1):
            sent = {}
            for name, full in assemble(dict(policy.parameters_and_names()), names, policy.config, train,
                                       self.layout.rank):
                comm.job_broadcast(full)
                if keep and comm.rank() == 0:
                    sent[name] = full
            return sent
        if comm.rank() != 0:
            weights = {}
        elif weights is None:
            weights = get_weights(policy)
            if keep:
                weights = {name: np.array(value) for name, value in weights.items()}
        for name in names:
            comm.job_broadcast(weights[name] if name in weights else
                               np.zeros(param_shape(name, policy.config), np.float32))
        return weights

    def pull_weights(self, sampler: Sampler, config) -> int:
        """The generators' side: the new weights, cut to this rank's infer shard, into ``sampler``; returns
        their policy version (the trainer steps they have taken)."""
        version = int(comm.job_broadcast(np.zeros(1, np.float32))[0])
        tp_rank = self.layout.infer.coords(self.layout.rank).tp

        def arrays():
            for name in model_names(config):
                full = comm.job_broadcast(np.zeros(param_shape(name, config), np.float32))
                yield name, np.ascontiguousarray(shard_tensor(name, full, config, self.layout.infer, tp_rank))

        sampler.load_weights(arrays())
        return version


class GenerationWorker:
    """A generator rank of a disaggregated job: it holds the sampler (its weights only: no optimizer, no
    reference, no rewards) and its replica's share of the prompts, and loops: sample the step's prompts with the
    step's seeds (``sampling.sample_batches``, as a colocated rank would), send them, wait for the new weights.
    ``run_stage`` drives it like a trainer: ``check_inputs`` and ``resume`` are no-ops (the trainers broadcast where
    the run starts) and ``train`` returns no metrics (rank 0, a trainer, logs them)."""

    def __init__(self, cfg, *, sampler: Sampler, dataset, layout: RunLayout, config, num_generations: int,
                 rollouts_per_step: int, stop_ids: List[int], tool_loop: Optional[ToolLoop] = None):
        self.cfg, self.sampler, self.dataset, self.layout, self.config = cfg, sampler, dataset, layout, config
        self.num_generations, self.rollouts_per_step, self.stop_ids = num_generations, rollouts_per_step, stop_ids
        #: The run's tools (``generation.tool_loop``): a generator runs them as a colocated rank would; None: none.
        self.tool_loop = tool_loop
        self.link = RolloutLink.of_job(cfg, layout, dataset.batch_size, rollouts_per_step, num_generations)

    def check_inputs(self) -> None:
        """Nothing to check: the trainers read the run's evaluation inputs."""

    def resume(self, path) -> None:
        """Nothing to load: the trainers resume and broadcast the step, data position and weights."""

    def train(self) -> list:
        """Sample every step of the run for the trainers; returns ``[]`` (no metrics here)."""

        step, drawn, total, weights = self.link.start()
        if total == 0:
            log.info("rank %d: the trainers replay recorded rollouts (replay_data_file): nothing to sample, this "
                     "generator rank stops", comm.rank())
            return []
        version = self.link.pull_weights(self.sampler, self.config) if weights else step
        replica = self.layout.infer_dp_rank
        one_step_off = self.cfg.parallel.max_staleness > 0
        dynamic = bool(getattr(self.cfg.algorithm, "dynamic_sampling", False))
        last_end = self.link.now()
        while step < total:
            step += 1
            faults.enter_step(step)
            faults.point("generate", comm.rank())
            more, round_index = True, 0
            while more:  # one round, or (dynamic sampling) until the trainers have enough groups
                batches = [(r, self.dataset.nth_batch(drawn + r)) for r in range(self.rollouts_per_step)]
                drawn += self.rollouts_per_step
                start = self.link.now()
                first = round_index * self.rollouts_per_step  # a colocated rank's rollout index of the round
                rollout = sample_batches(self.sampler, self.dataset, batches, lambda r, s=step, f=first:
                                         sampling_params(self.cfg, s, f + r, replica, self.num_generations,
                                                         self.stop_ids), self.tool_loop)
                end = self.link.now()
                # Idle: since the last sampling ended (sending those rows, waiting for weights or the word).
                self.link.send(rollout.completions, version, (start, end, start - last_end))
                last_end = end
                more = dynamic and self.link.more_rounds()
                round_index += 1
            # One step off: step 1's rows go out before any update, so the generators sample step 2's at once with
            # the same weights; from then on the trainers push update s - 1 once they hold step s's rows, which
            # arrives here after step s + 1's rows went out (the trainers' side: RolloutTrainer._received_rollout).
            if not (one_step_off and step == 1):
                version = self.link.pull_weights(self.sampler, self.config)
        return []


def build_generator(cfg, layout: RunLayout, tokenizer, config, *, num_generations: int, rollouts_per_step: int,
                    batch_size: int) -> GenerationWorker:
    """A generator rank's worker: its infer shard of the model (``sft_path_infer``'s weights when that names
    another checkpoint, else the policy's, which the trainers broadcast before the first step), the sampler the
    config asks for, and its replica's share of the prompts (``batch_size`` per global batch)."""
    from mindrlhf.generation.factory import build_sampler
    from mindrlhf.generation.tool_loop import tool_loop_of
    from mindrlhf.models import CausalLM
    from mindrlhf.parallel.resharding import load_shard

    dtype = cfg.model.dtype
    if cfg.generator_checkpoint():
        model = load_shard(cfg.generator_checkpoint(), layout.infer, layout.rank, dtype=dtype,
                           tp_group=layout.infer_tp_group)
    else:
        model = CausalLM(config, dtype, layout.infer_shard())
    dataset = load_prompt_dataset(cfg, layout, tokenizer, config, batch_size)
    stop_ids = list(cfg.generation.stop_token_ids) or list(tokenizer.stop_token_ids)
    return GenerationWorker(cfg, sampler=build_sampler(cfg, model), dataset=dataset, layout=layout, config=config,
                            num_generations=num_generations, rollouts_per_step=rollouts_per_step, stop_ids=stop_ids,
                            tool_loop=tool_loop_of(cfg, tokenizer))


