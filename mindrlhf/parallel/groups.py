"""Communication groups of a parallel layout, created once per process.

Every collective in tensor, data and pipeline parallelism runs in a named sub-group of the world:
the tp group (one model replica's slices), the dp group (ranks holding the same slice), the pp
group (one pipeline), the two-rank groups joining adjacent stages (point-to-point hand-off, see
``parallel.pipeline``) and the embedding group (first and last stage of a tied model).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from mindrlhf.errors import MindRLHFError
from mindrlhf.parallel.layout import ModelShard, ParallelLayout


def group_name(kind: str, ranks) -> str:
    """Deterministic communication-group name, e.g. ``mindrlhf_tp_0_1`` (same on every member)."""
    return f"mindrlhf_{kind}_" + "_".join(str(int(r)) for r in ranks)


@dataclass(frozen=True)
class ParallelGroups:
    """This process's place in a layout and the names of its communication groups.

    A group name is ``None`` when the group would have one member (no collective needed).
    ``prev_group`` / ``next_group`` join this stage to the previous / next one of its pipeline.
    """

    layout: ParallelLayout
    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_group: Optional[str]
    dp_group: Optional[str]
    pp_group: Optional[str]
    prev_group: Optional[str]
    next_group: Optional[str]
    embed_group: Optional[str]

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    def shard(self) -> ModelShard:
        """The model shard this rank holds."""
        return ModelShard.of(self.layout, self.rank, self.tp_group)


def layout_groups(layout: ParallelLayout) -> List[Tuple[str, List[int]]]:
    """Every multi-rank group of the layout as ``(kind, ranks)``, in one global order.

    All ranks create their groups in this order, so no two ranks can wait on each other's
    creation in opposite orders.
    """
    groups = [("tp", g) for g in layout.tp_groups()] + [("dp", g) for g in layout.dp_groups()]
    groups += [("pp", g) for g in layout.pp_groups()]
    for pipe in layout.pp_groups():
        groups += [("p2p", [a, b]) for a, b in zip(pipe, pipe[1:])]
    if layout.pp > 1:
        groups += [("embed", g) for g in layout.embedding_groups()]
    return [(kind, ranks) for kind, ranks in groups if len(ranks) > 1]


def init_parallel_groups(layout: ParallelLayout, rank: Optional[int] = None,
                         world_size: Optional[int] = None) -> ParallelGroups:
    """Create (``mindspore.communication.create_group``) the groups this rank belongs to.

    Call after ``mindspore.communication.init()`` on every rank; the world size (default: msrun's; a
    disaggregated job's trainers pass their side's) must equal ``layout.world_size`` (the error names both
    numbers). Ranks are global ones (a disaggregated job's trainers are ranks ``0..N-1``).
    """
    from mindspore.communication import create_group, get_group_size, get_rank

    layout.validate(world_size=get_group_size() if world_size is None else world_size)
    rank = get_rank() if rank is None else rank
    coords = layout.coords(rank)
    mine = {}
    for kind, ranks in layout_groups(layout):
        if rank in ranks:
            name = group_name(kind, ranks)
            create_group(name, list(ranks))
            if kind == "p2p":
                kind = "next" if ranks[0] == rank else "prev"
            mine[kind] = name
    return ParallelGroups(layout=layout, rank=rank, tp_rank=coords.tp, dp_rank=coords.dp, pp_rank=coords.pp,
                          tp_group=mine.get("tp"), dp_group=mine.get("dp"), pp_group=mine.get("pp"),
                          prev_group=mine.get("prev"), next_group=mine.get("next"), embed_group=mine.get("embed"))


def data_parallel_groups(rank: int = 0, world_size: int = 1) -> ParallelGroups:
    """Pure data parallelism over the whole world (dp = world size): no sub-groups are needed
    (dp collectives use the world group), so nothing is created."""
    layout = ParallelLayout(dp=world_size)
    return ParallelGroups(layout=layout, rank=rank, tp_rank=0, dp_rank=rank, pp_rank=0, tp_group=None,
                          dp_group=None, pp_group=None, prev_group=None, next_group=None, embed_group=None)


@dataclass(frozen=True)
class RunLayout:
    """The train and generation layouts of one job, and this rank's place in both.

    Colocated (``gen_workers`` 0): training runs on ``train`` (dp × tp × pp, groups ``groups``) and generation
    on ``infer`` (dp × tp, no pipeline) over the same processes. A dp replica's tp/pp ranks hold the same rows,
    so per-row data crosses ranks only through a *representative* of each replica.

    Disaggregated (``gen_workers`` K > 0, ``disaggregated_layouts``): ranks ``[0, N)`` train on ``train`` and ranks
    ``[N, N + K)`` only generate on ``infer``; ``generator`` says which this rank is and ``rank`` is its place in
    its own side's layout (a trainer's equals its global rank).
    """

    train: ParallelLayout
    infer: ParallelLayout
    groups: ParallelGroups
    infer_tp_group: Optional[str]
    rank: int
    gen_workers: int = 0
    generator: bool = False

    @property
    def disaggregated(self) -> bool:
        """Whether generation has ranks of its own (``gen_workers`` > 0)."""
        return self.gen_workers > 0

    @property
    def data_shard(self) -> Tuple[int, int]:
        """``(shard, shards)`` of the prompt dataset this rank reads: its generator replica's share of every
        batch; a trainer of a disaggregated job reads whole batches (it scores the rows of every generator)."""
        if self.disaggregated and not self.generator:
            return 0, 1
        return self.infer_dp_rank, self.infer.dp

    @property
    def pure_dp(self) -> bool:
        """Plain data parallelism everywhere (each rank trains and generates its own rows)."""
        return self.train.tp == 1 and self.train.pp == 1 and self.infer.tp == 1

    @property
    def shared_generator(self) -> bool:
        """Whether the generator can be the policy itself (same tp slices, no pipeline, same replicas)."""
        return (self.train.pp == 1 and self.train.tp == self.infer.tp and self.train.dp == self.infer.dp)

    @property
    def train_dp_rank(self) -> int:
        return self.train.coords(self.rank).dp

    @property
    def infer_dp_rank(self) -> int:
        return self.infer.coords(self.rank).dp

    @property
    def train_representative(self) -> bool:
        """tp rank 0 of the first stage: speaks for its training replica's rows."""
        c = self.train.coords(self.rank)
        return c.tp == 0 and c.pp == 0

    @property
    def infer_representative(self) -> bool:
        """tp rank 0 of a generator replica: speaks for the rows it generated."""
        return self.infer.coords(self.rank).tp == 0

    def infer_shard(self) -> ModelShard:
        return ModelShard.of(self.infer, self.rank, self.infer_tp_group)


def init_run_layout(train: ParallelLayout, infer: ParallelLayout, rank: int, world_size: int) -> RunLayout:
    """Create the communication groups of a job's train and infer layouts (none for pure dp)."""
    train.validate(world_size=world_size)
    infer.validate(world_size=world_size)
    if train.tp == 1 and train.pp == 1:
        groups = data_parallel_groups(rank, world_size)
    else:
        groups = init_parallel_groups(train, rank)
    infer_group = None
    if infer.tp > 1:
        members = infer.tp_group(rank)
        if train.pp == 1 and train.tp == infer.tp:
            infer_group = groups.tp_group  # the same ranks: reuse the train tp group
        else:
            from mindspore.communication import create_group

            # Every rank creates all infer tp groups it belongs to, in rank order (one each).
            infer_group = group_name("infer_tp", members)
            create_group(infer_group, list(members))
    return RunLayout(train=train, infer=infer, groups=groups, infer_tp_group=infer_group, rank=rank)


def disaggregated_layouts(world: int, gen_workers: int, train: ParallelLayout, infer: ParallelLayout,
                          train_dp_given: bool = True) -> Tuple[ParallelLayout, ParallelLayout]:
    """The train and infer layouts of a job whose last ``gen_workers`` of ``world`` ranks only generate.

    The ``world - gen_workers`` trainers take ``train`` (its dp derived from them unless ``train_dp_given``);
    the generators take ``infer``, which must fill them. Impossible numbers are one-line errors naming them.
    """
    trainers = world - gen_workers
    if gen_workers < 1 or trainers < 1:
        raise MindRLHFError(f"gen_workers = {gen_workers} of a world of {world} workers leaves {trainers} to train; "
                            f"launch more workers (msrun --worker_num > {gen_workers}) or lower gen_workers")
    per_replica = train.tp * train.pp
    if not train_dp_given:
        if trainers % per_replica:
            raise MindRLHFError(f"the {trainers} trainer ranks (world {world} - gen_workers {gen_workers}) are not a "
                                f"multiple of train_tp*train_pp = {train.tp}*{train.pp}; change gen_workers or the "
                                "train layout")
        train = ParallelLayout(dp=trainers // per_replica, tp=train.tp, pp=train.pp, micro_batches=train.micro_batches)
    if train.world_size != trainers:
        raise MindRLHFError(f"train_dp*train_tp*train_pp = {train.dp}*{train.tp}*{train.pp} = {train.world_size} but "
                            f"world {world} - gen_workers {gen_workers} leaves {trainers} trainer ranks; set train_dp "
                            f"{trainers // per_replica if trainers % per_replica == 0 else '?'} (or leave it unset) or "
                            f"launch {train.world_size + gen_workers} workers")
    if infer.world_size != gen_workers:
        raise MindRLHFError(f"infer_dp*infer_tp = {infer.dp}*{infer.tp} = {infer.world_size} does not fill the "
                            f"gen_workers = {gen_workers} generator ranks; set infer_dp {gen_workers // infer.tp or 1}")
    return train, infer


def init_disaggregated_layout(train: ParallelLayout, infer: ParallelLayout, rank: int) -> RunLayout:
    """This rank's side of a disaggregated job (``disaggregated_layouts`` gave both layouts): ranks
    ``[0, train.world_size)`` train, the rest generate. Makes this process's collectives those of its side
    (``comm.enter_scope``): the trainers then run the colocated training code as a job of their own, and only
    ``comm.job_*`` collectives span both sides. The trainers create their train layout's tp/dp/pp groups (their
    global ranks are their ranks in it); the generators the infer tp groups among themselves (global ranks
    ``N + r`` for generator ``r``)."""
    from mindrlhf.parallel import comm

    trainers = train.world_size
    generator = rank >= trainers
    side = list(range(trainers, trainers + infer.world_size)) if generator else list(range(trainers))
    comm.enter_scope(side, "gen" if generator else "train")
    local = rank - side[0]
    infer_group = None
    if generator:
        groups = data_parallel_groups(local, len(side))
        if infer.tp > 1:
            from mindspore.communication import create_group

            members = [side[0] + r for r in infer.tp_group(local)]
            infer_group = group_name("infer_tp", members)
            create_group(infer_group, members)
    elif train.tp == 1 and train.pp == 1:
        groups = data_parallel_groups(local, len(side))
    else:
        groups = init_parallel_groups(train, local, world_size=len(side))
    return RunLayout(train=train, infer=infer, groups=groups, infer_tp_group=infer_group, rank=local,
                     gen_workers=infer.world_size, generator=generator)
