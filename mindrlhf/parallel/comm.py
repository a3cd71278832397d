"""Process-group facts and the few collectives the trainer needs (data parallel).

On CPU (backend mccl) AllReduce-sum, AllGather and world-group Broadcast work; max-reductions,
ReduceScatter and point-to-point do not, and AllGather has no kernel in a sub-group, so everything
here is built from sum and gather. With one process every function is the identity, so
single-process runs need no launcher.

**Scope.** ``rank``'s collectives, ``world_size`` and ``barrier`` are those of this process's *side*
of the job: the whole world, unless a disaggregated rollout (``groups.init_disaggregated_layout``)
made the trainers and the generators sides of their own (``enter_scope``): then the trainers run the
colocated training code unchanged, as a job of ``world_size()`` processes. ``rank()`` stays the global
rank (the trainers are ranks ``0..N-1``, so for them it is also their rank in the side). The
``job_*`` functions always span the whole job: the rollouts and weights that cross the sides.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Optional

import numpy as np
from mindspore import Tensor, ops

# size/group/first: this process's side (see "Scope"); job_size: the whole world.
_STATE = {"initialised": False, "rank": 0, "size": 1, "timeout": "", "group": None, "first": 0, "job_size": 1}
log = logging.getLogger("mindrlhf")

# The environment variable that bounds how long one collective waits for its peers, per device:
# MindSpore's CPU collectives (mccl) and HCCL read it when communication is initialised.
# NCCL (GPU) has no such bound.
COLLECTIVE_TIMEOUT_ENV = {"CPU": "MS_CPU_COMM_OP_TIMEOUT", "Ascend": "HCCL_EXEC_TIMEOUT"}
# How MindSpore reports a collective that failed or timed out: the kernel launch of a collective op
# (pynative or graph), the CPU ring's wait, or an HCCL task timeout.
_COLLECTIVE_FAILURE = re.compile(
    r"(Launch kernel failed(, name)?:\s*\S*?"
    r"(AllReduce|AllGather|Broadcast|ReduceScatter|AllToAll|Send|Receive|Barrier))"
    r"|CollectiveWait|EI0002|EI0006|HCCL[^\n]*?(?i:time ?out|timed out)")


def launched_by_msrun() -> bool:
    """True when started by msrun / a MindSpore distributed launcher."""
    return "MS_WORKER_NUM" in os.environ or int(os.environ.get("RANK_SIZE", "1")) > 1


def init_distributed(collective_timeout: Optional[int] = None, device_target: str = "CPU") -> None:
    """Initialise communication once (only when launched with several workers).

    ``collective_timeout`` (seconds): a collective that waits longer for its peers fails (a worker
    died or hangs), so the survivors stop instead of waiting forever. A value already set in the
    environment by the user wins.
    """
    if _STATE["initialised"]:
        return
    if launched_by_msrun():
        from mindspore.communication import get_group_size, get_rank, init

        env = COLLECTIVE_TIMEOUT_ENV.get(device_target)
        if collective_timeout is not None and env:
            if env in os.environ and os.environ[env] != str(collective_timeout):
                log.info("collective timeout: %s=%s from the environment (not collective_timeout=%d)",
                         env, os.environ[env], collective_timeout)
            os.environ.setdefault(env, str(collective_timeout))
            _STATE["timeout"] = f"{os.environ[env]} s ({env})"
        init()
        _STATE.update(rank=get_rank(), size=get_group_size(), job_size=get_group_size())
    _STATE["initialised"] = True


def enter_scope(ranks, kind: str) -> None:
    """Make ``ranks`` (consecutive global ranks holding this one) this process's side: from now on
    ``world_size``, ``all_sum``, ``all_gather``, ``barrier`` and ``grad_reducer`` span them only. Every member
    calls it (the sub-group ``mindrlhf_<kind>_...`` is created when it has several members)."""
    ranks = [int(r) for r in ranks]
    if rank() not in ranks or ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        raise ValueError(f"enter_scope: rank {rank()} is not one of the consecutive ranks {ranks}")
    group = None
    if len(ranks) > 1 and len(ranks) < job_size():
        from mindspore.communication import create_group

        group = f"mindrlhf_{kind}_" + "_".join(map(str, ranks))
        create_group(group, ranks)
    _STATE.update(size=len(ranks), group=group, first=ranks[0])


def collective_failure(err: BaseException) -> Optional[str]:
    """The collective named in ``err`` when it is MindSpore's report of a collective that failed or
    timed out (a peer worker died or hangs), e.g. 'AllGather'; None for any other error."""
    if not isinstance(err, RuntimeError):
        return None
    match = _COLLECTIVE_FAILURE.search(str(err))
    if match is None:
        return None
    return match.group(3) or "a collective"


def collective_timeout_text() -> str:
    """How long a collective waits before it fails, as set at initialisation (for messages)."""
    return _STATE["timeout"] or "the communication library's timeout"


def rank() -> int:
    """This process's global rank (0 when not distributed)."""
    return _STATE["rank"]


def world_size() -> int:
    """Number of processes of this side of the job (1 when not distributed; see "Scope")."""
    return _STATE["size"]


def job_size() -> int:
    """Number of processes of the whole job, both sides of a disaggregated one (1 when not distributed)."""
    return _STATE["job_size"]


def _all_reduce():
    group = _STATE["group"]
    return ops.AllReduce(group=group) if group else ops.AllReduce()


def is_main() -> bool:
    return rank() == 0


def all_sum(x: np.ndarray) -> np.ndarray:
    """Element-wise sum over all ranks (sent as float32: integers stay exact below 2**24)."""
    x = np.asarray(x)
    if world_size() == 1:
        return x
    dtype = x.dtype
    out = _all_reduce()(Tensor(x.astype(np.float32))).asnumpy()
    return out.astype(dtype) if np.issubdtype(dtype, np.integer) else out


def all_gather(x: np.ndarray) -> np.ndarray:
    """Concatenate each rank's array along axis 0, in rank order (shapes must agree beyond axis 0)."""
    x = np.asarray(x)
    if world_size() == 1:
        return x
    if _STATE["group"]:
        return _gather_by_sum(x)
    # AllGather needs equal shapes: exchange lengths first, pad, gather, then trim.
    n = np.array([x.shape[0]], np.float32)
    lengths = ops.AllGather()(Tensor(n)).asnumpy().astype(int)
    pad = int(lengths.max()) - x.shape[0]
    dtype = x.dtype
    work = x.astype(np.float32) if x.dtype != np.float32 else x
    if pad:
        work = np.concatenate([work, np.zeros((pad,) + work.shape[1:], np.float32)])
    gathered = ops.AllGather()(Tensor(np.ascontiguousarray(work))).asnumpy()
    step = int(lengths.max())
    parts = [gathered[i * step: i * step + int(lengths[i])] for i in range(world_size())]
    return np.concatenate(parts).astype(dtype)


def _gather_by_sum(x: np.ndarray) -> np.ndarray:
    """``all_gather`` in a sub-group, where CPU has no AllGather kernel: each rank writes its rows into its own
    slot of a zero buffer and the buffers are summed (exact: every element is one value plus zeros)."""
    me, size = rank() - _STATE["first"], world_size()
    slots = np.zeros(size, np.float32)
    slots[me] = x.shape[0]
    lengths = all_sum(slots).astype(int)
    buf = np.zeros((size, int(lengths.max())) + x.shape[1:], np.float32)
    buf[me, :x.shape[0]] = x
    summed = all_sum(buf)
    return np.concatenate([summed[i, :lengths[i]] for i in range(size)]).astype(x.dtype)


def job_all_gather(x: np.ndarray) -> np.ndarray:
    """Every rank's float32 ``x`` (the same shape on all) stacked in global rank order over the whole job,
    whatever the scope: shape ``(job_size(), *x.shape)``. One fixed-shape AllGather."""
    x = np.ascontiguousarray(x, np.float32)
    if job_size() == 1:
        return x[None]
    return ops.AllGather()(Tensor(x[None])).asnumpy()


def job_broadcast(x: np.ndarray, root: int = 0) -> np.ndarray:
    """Global rank ``root``'s float32 ``x`` on every rank of the whole job (the others pass an array of its shape,
    whose values are ignored). One world-group Broadcast."""
    x = np.ascontiguousarray(x, np.float32)
    if job_size() == 1:
        return x
    return ops.Broadcast(root)((Tensor(x),))[0].asnumpy()


def job_barrier() -> None:
    """Wait until every rank of the whole job gets here, whatever the scope (no-op on one process)."""
    if job_size() > 1:
        ops.AllReduce()(Tensor(np.zeros(1, np.float32))).asnumpy()


def grad_reducer(parameters, size: Optional[int] = None, group: Optional[str] = None):
    """A gradient reducer that SUMS over ``group`` of ``size`` ranks (default: the world), or None if size is 1.

    Sums, not means: losses are pre-normalised by global counts. Under tensor parallelism pass the
    dp group: the ranks of a tp group hold different slices of equal shapes, and a world-group
    reduce would silently add them together.
    """
    size = world_size() if size is None else size
    if size == 1:
        return None
    from mindspore import nn

    group = group or _STATE["group"]  # this side's group (see "Scope")
    if group is None:
        if size != world_size():
            raise ValueError(f"grad_reducer: size={size} needs the name of its {size}-rank communication group")
        return nn.DistributedGradReducer(parameters, mean=False, degree=size)
    return nn.DistributedGradReducer(parameters, mean=False, degree=size, group=group)


def barrier() -> None:
    """Wait until every rank gets here (a tiny all-reduce; no-op on one process)."""
    if world_size() > 1:
        all_sum(np.zeros(1, np.float32))
