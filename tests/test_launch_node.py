"""scripts/launch_node.sh refuses bad launcher flags with one error line (exit 2) before msrun starts."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "launch_node.sh"


@pytest.mark.parametrize("flags, message", [
    (["--nodes", "2", "--node_rank", "2", "--master_addr", "10.0.0.1"], "--node_rank 2 must be below --nodes 2"),
    (["--nodes", "two", "--node_rank", "0", "--master_addr", "10.0.0.1"], "--nodes 'two' must be a whole number"),
    (["--nodes", "2", "--node_rank", "0"], "--master_addr is required"),
    (["--nodes", "2", "--node_rank", "0", "--master_addr", "h", "--workers_per_node", "x"],
     "--workers_per_node 'x' must be a whole number"),
    (["--nodes", "2", "--node_rank", "0", "--master_addr", "h", "--lr", "1e-5"], "unknown option --lr"),
])
def test_bad_launcher_flags_are_one_clear_error(flags, message):
    res = subprocess.run(["bash", str(SCRIPT), *flags, "--", "--max_steps", "1"], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.splitlines()[0].startswith("error: ") and message in res.stderr.splitlines()[0], res.stderr
