"""Telling a lost worker from other errors (the msrun kill tests are in test_grpo_e2e.py)."""
from __future__ import annotations

import pytest

from mindrlhf.errors import MindRLHFError, WorkerLostError
from mindrlhf.parallel import comm
from mindrlhf.utils import faults
from mindrlhf.utils.cli import run_cli

# MindSpore 2.10's reports on CPU when a peer died, as seen in the kill tests' worker logs:
# a pynative collective, and one inside a compiled graph (the gradient reducer).
PYNATIVE = "Launch kernel failed, name:Default/AllGather-op0\n\n----\n- C++ Call Stack:\n----\nop_runner.cc:671"
GRAPH = ("\n----------\n- Kernel error:\n----------\nLaunch kernel failed: Default/AllReduce-op0\n----------\n"
         "- The Function Call Stack (For framework developers)\n")


@pytest.mark.parametrize("message, op", [
    (PYNATIVE, "AllGather"),
    (GRAPH, "AllReduce"),
    ("Launch kernel failed, name:Default/network/Broadcast-op7", "Broadcast"),
    ("EI0002: The wait execution of the Notify register times out.", "a collective"),
    ("Launch kernel failed, name:Default/MatMul-op3", None),     # a compute kernel: not a lost peer
    ("HCCL init failed: rank table file not found", None),        # a setup error, not a timeout
])
def test_collective_failures_are_recognised(message, op):
    assert comm.collective_failure(RuntimeError(message)) == op


def test_only_runtime_errors_count():
    assert comm.collective_failure(ValueError(PYNATIVE)) is None


def test_lost_worker_exits_3_and_bad_input_2(capsys):
    def lost(argv):
        raise WorkerLostError("worker rank 1 of 2: AllReduce got no answer")

    def bad(argv):
        raise MindRLHFError("lr = 1e6 is above 0.1")

    assert run_cli(lost, []) == 3 and run_cli(bad, []) == 2
    assert capsys.readouterr().err.splitlines() == ["error: worker rank 1 of 2: AllReduce got no answer",
                                                    "error: lr = 1e6 is above 0.1"]


def test_fault_points_fire_only_where_named(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1:3:generate")
    faults.enter_step(3)
    faults.point("generate", rank=0)          # another rank
    faults.point("grad_allreduce", rank=1)    # another point
    faults.enter_step(2)
    faults.point("generate", rank=1)          # another step: still alive
    monkeypatch.setenv(faults.ENV, "1:3:backward")
    with pytest.raises(ValueError, match="generate, grad_allreduce"):
        faults.point("generate", rank=1)
