"""The README's commands and the CI script stay in agreement."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _readme_commands(name: str) -> list:
    text = (REPO / name).read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line for b in blocks[:2] for line in b.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_exactly_the_readme_test_command():
    main_cmd, test_cmd = _readme_commands("README.md")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_cmd in ci
    assert main_cmd == "bash scripts/quickstart.sh"
    assert (REPO / "scripts" / "quickstart.sh").is_file()


def test_chinese_readme_has_the_same_first_two_commands():
    assert _readme_commands("README_CN.md") == _readme_commands("README.md")
