"""The README's commands, the CI script and the docs stay in agreement with the code."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mindrlhf.registry import STAGES

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "mindrlhf"
DOCS = [REPO / "README.md", REPO / "README_CN.md", REPO / "bench" / "README.md", REPO / "tests" / "data" / "README.md",
        *sorted((REPO / "docs").rglob("*.md"))]
#: Where the shell blocks live: the two READMEs and the documentation site's pages.
COMMAND_DOCS = [REPO / "README.md", REPO / "README_CN.md", *sorted((REPO / "docs").rglob("*.md"))]


def _readme_commands(name: str) -> list:
    text = (REPO / name).read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line for b in blocks[:2] for line in b.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_both_readme_commands_verbatim():
    main_cmd, test_cmd = _readme_commands("README.md")
    assert (main_cmd, test_cmd) == ("bash scripts/quickstart.sh", "bash scripts/test.sh")
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    # Command 1 shortened by flags only, its outputs checked, then command 2 exactly.
    first = next(i for i, line in enumerate(ci) if line.startswith(main_cmd + " "))
    assert "--max_steps 1" in ci[first] and "--output_dir .ci_out/grpo" in ci[first]
    assert ci[first + 1] == ".venv/bin/python .ci/check_quickstart.py .ci_out/grpo 1"
    assert test_cmd in ci[first + 2:]
    for script in ("quickstart.sh", "test.sh", "_env.sh"):
        assert (REPO / "scripts" / script).is_file()


def test_a_new_shell_runs_the_other_commands_as_the_readme_says():
    """After command 1, `mindrlhf-sft` was not found in a new shell (exit 127) and the README said nothing
    needs activating. The README and command 1's last line say to activate the environment; doing so in a shell
    that has nothing of it (this suite runs in that environment: its python's bin/) finds the commands."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "in a new shell run `source .venv/bin/activate` first" in readme
    assert "run 'source $VIRTUAL_ENV/bin/activate' first" in (REPO / "scripts" / "quickstart.sh").read_text()
    activate = Path(sys.executable).parent / "activate"
    shell = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}  # a new shell: no virtualenv on PATH
    proc = subprocess.run(["bash", "-c", f"source {activate} && mindrlhf-sft --help && mindrlhf-data --help"],
                          env=shell, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: mindrlhf-sft" in proc.stdout and "--pairs" in proc.stdout


def test_chinese_readme_has_the_same_first_two_commands():
    assert _readme_commands("README_CN.md") == _readme_commands("README.md")


def _code_spans() -> list:
    return sorted({(doc.relative_to(REPO).as_posix(), span) for doc in DOCS
                   for span in re.findall(r"`([^`\s]+)`", doc.read_text(encoding="utf-8"))})


def _resolve(name: str) -> bool:
    """Import the longest module prefix of a dotted name under mindrlhf, then follow attributes."""
    parts = name.split(".")
    if parts[0] != "mindrlhf":
        if (PKG / parts[0]).is_dir() or (PKG / f"{parts[0]}.py").is_file():
            parts = ["mindrlhf", *parts]
        else:  # a class name: the module that defines it
            hits = [p for p in PKG.rglob("*.py") if re.search(rf"^class {re.escape(parts[0])}\b",
                                                              p.read_text(encoding="utf-8"), re.M)]
            if not hits:
                return False
            module = ".".join(hits[0].relative_to(REPO).with_suffix("").parts)
            parts = [*module.split("."), *parts]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _ours(span: str) -> bool:
    """A dotted name that belongs to mindrlhf: under the package, or a class the package defines."""
    first = span.split(".")[0]
    if first == "mindrlhf" or (PKG / first).is_dir():
        return True
    return first[:1].isupper() and any(re.search(rf"^class {re.escape(first)}\b", p.read_text(encoding="utf-8"), re.M)
                                       for p in PKG.rglob("*.py"))


def test_every_dotted_name_in_the_docs_exists():
    names = [(doc, s) for doc, s in _code_spans()
             if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", s) and not s.endswith(".py") and _ours(s)]
    assert len(names) >= 5  # the check sees the docs' names (e.g. mindrlhf.trainer.entry.setup_runtime)
    missing = [f"{doc}: {s}" for doc, s in names if not _resolve(s)]
    assert not missing, missing


def test_every_repository_path_in_the_docs_exists():
    files = {p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if ".git" not in p.parts}
    names = {Path(f).name for f in files}
    checked, missing = 0, []
    for doc, span in _code_spans():
        path = span.rstrip("/")
        if not re.fullmatch(r"[\w.\-/]+", path) or "/" not in span and not span.endswith(".py"):
            continue
        roots = ("mindrlhf/", "tests/", "docs/", "bench/", "scripts/", ".ci/", "examples/", "model_configs/")
        if span.endswith(".py") and "/" not in span:
            ok = span in names
        elif span.startswith(roots):
            ok = path in files
        elif (PKG / path.split("/")[0]).is_dir() and (span.endswith(("/", ".py"))):  # trainer/metrics.py
            ok = f"mindrlhf/{path}" in files
        else:
            continue  # an output or user path (output/grpo/, checkpoints/step_N/) or a metric name
        checked += 1
        if not ok:
            missing.append(f"{doc}: {span}")
    assert checked >= 20 and not missing, missing


def test_ruff_clean():  # ruff comes with the test extra
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_every_readme_training_command_is_a_valid_config():
    """The recipes and reproduce commands of the READMEs and the docs pages parse and validate (flags joined over
    line breaks): every ``mindrlhf-<stage>`` of the stage table, ``examples/stages/run.py STAGE`` under msrun, the
    node launches."""
    import shlex

    parsers = {stage.script: stage.config_class().parse_args for stage in STAGES.values()}
    seen = 0
    for doc in COMMAND_DOCS:
        text = doc.read_text(encoding="utf-8")
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for command in block.replace("\\\n", " ").splitlines():
                words = shlex.split(command, comments=True)
                if words[:1] and words[0] in parsers:
                    parsers[words[0]](words[1:])
                    seen += 1
                elif words[:1] == ["msrun"] and RUN_SCRIPT in words:
                    at = words.index(RUN_SCRIPT)
                    parsers["mindrlhf-" + words[at + 1]](words[at + 2:])
                    seen += 1
                elif words[:2] == ["bash", "scripts/launch_node.sh"]:  # the training flags follow "--"
                    parsers["mindrlhf-grpo"](words[words.index("--") + 1:])
                    seen += 1
                elif words[:2] == ["python", "examples/grpo/qwen_grpo_tutorial/main.py"]:  # MindRLHF's main.py
                    from mindrlhf.configs.mindrlhf_yaml import parse_main_args

                    parse_main_args(words[2:])
                    seen += 1
    assert seen >= 36  # in each language: the results run, the DAPO and Dr.GRPO recipes, the node launches, the stages


RUN_SCRIPT = "examples/stages/run.py"


def _stage_modules() -> dict:
    """The stage table's recipe modules: dotted name -> stage name."""
    return {stage.module: name for name, stage in STAGES.items()}


def _stage_imports(path: Path) -> set:
    """The stages whose recipe module (the stage table's ``module``) a file imports, anywhere in it (function
    bodies too)."""
    import ast

    modules = _stage_modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {stage for module, stage in modules.items()
                  if any(n == module or n.startswith(module + ".") for n in names)}
    return found


def test_no_stage_file_imports_another():
    """design.md: each stage is one recipe file on the shared core; what two stages share lives in the core
    (dpo.py once imported mindrlhf.rm for its pair reader, now data.text_rows.read_pairs)."""
    crossed = {stage: sorted(_stage_imports(REPO / (module.replace(".", "/") + ".py")) - {stage})
               for module, stage in _stage_modules().items()}
    assert not {s: i for s, i in crossed.items() if i}, crossed
    assert _stage_imports(REPO / "tests" / "test_ppo.py")  # the check sees imports (tests import stages)


def test_console_scripts_are_the_stage_table():
    """pyproject.toml's console scripts are static text: each stage of the table has ``mindrlhf-<name> =
    "<module>:main"``, and no other script points at a stage module (a stage added to one but not the other)."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    modules = _stage_modules()
    listed = {script: target for script, target in scripts.items() if target.split(":")[0] in modules}
    assert listed == {stage.script: stage.entry_point for stage in STAGES.values()}
    for stage in STAGES.values():  # the module is where the table says, with the main the script calls
        assert (REPO / (stage.module.replace(".", "/") + ".py")).is_file(), stage.module
        assert stage.config_class().REFERENCE_FILE == stage.reference, stage.name


def test_run_script_names_the_stages_on_a_bad_stage():
    """``examples/stages/run.py`` with an unknown stage: one line listing the table's stages, exit 2."""
    proc = subprocess.run([sys.executable, RUN_SCRIPT, "kto", "--max_steps", "1"], cwd=REPO, capture_output=True,
                          text=True)
    assert (proc.returncode, proc.stderr) == (2, "error: unknown stage 'kto'; choose one of grpo, sft, rm, dpo, "
                                                 "orpo, ppo\n")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STAGES))
def test_every_stage_runs_as_module_script_and_run_py(name):
    """``python -m <module> --help`` (what the console script runs) and ``examples/stages/run.py NAME --help``
    print the same options: the stage's config fields."""
    stage = STAGES[name]
    outs = [subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            for cmd in ([sys.executable, "-m", stage.module, "--help"], [sys.executable, RUN_SCRIPT, name, "--help"])]
    assert [p.returncode for p in outs] == [0, 0], [p.stderr[-500:] for p in outs]
    helps = [p.stdout.split("\n", 2)[2] for p in outs]  # past the "usage: <prog>" line
    assert helps[0] == helps[1] and stage.reference in helps[0]
    assert all(f"--{field}" in helps[0] for field in stage.config_class().field_index())



def _command_sections() -> dict:
    """docs/reference/commands.md's sections by the console scripts their headings name."""
    text = (REPO / "docs" / "reference" / "commands.md").read_text(encoding="utf-8")
    return {script: section for section in re.split(r"^## ", text, flags=re.M)[1:]
            for script in re.findall(r"`(mindrlhf-[a-z-]+)`", section.splitlines()[0])}


def test_every_tool_option_is_in_the_commands_reference():
    """Each console script that is not a stage (the stages' options are their generated config references) has a
    section in docs/reference/commands.md, and every option its ``--help`` usage lists is named in that section."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    stages = {stage.script for stage in STAGES.values()}
    sections = _command_sections()
    assert "mindrlhf-vllm-serve" in sections and "mindrlhf-grpo" in sections
    missing = []
    for script, target in sorted(scripts.items()):
        if script in stages:
            continue
        assert script in sections, f"docs/reference/commands.md has no section for {script}"
        proc = subprocess.run([sys.executable, "-m", target.split(":")[0], "--help"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, (script, proc.stderr[-1000:])
        usage = proc.stdout.split("\n\n", 1)[0]  # the usage lines name every option
        options = set(re.findall(r"\[?(--[a-z][a-z_]*)", usage)) - {"--help"}
        assert options, script
        missing += [f"{script} {o}" for o in sorted(options) if not re.search(rf"{o}\b", sections[script])]
    assert not missing, missing


COMMIT = re.compile(r"(?<![\w.])[0-9a-f]{7}(?![\w.])")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _undated_commits(text: str, before: int = 80, after: int = 100) -> list:
    """The dates of ``text`` with no commit within ``before`` / ``after`` characters (whitespace collapsed)."""
    flat = " ".join(text.split())
    return [flat[max(0, m.start() - 40):m.end() + 40] for m in DATE.finditer(flat)
            if not COMMIT.search(flat[max(0, m.start() - before):m.end() + after])]


def test_every_benchmark_figure_names_its_date_and_commit():
    """docs/benchmarks.md's tables: every row has a date and a commit; in the docs pages every dated figure names
    the commit measured or the one that recorded it, beside its date. (docs/design.md, whose decisions quote their
    measurements, is not checked here.)"""
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines()
            if line.startswith("| ") and not re.match(r"\| (---|measure |date )", line)]
    assert len(rows) >= 15, rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        dates = [c for c in cells if DATE.fullmatch(c)]
        assert len(dates) == 1 and any(COMMIT.search(c) for c in cells if not DATE.fullmatch(c)), row
    pages = [p for p in sorted((REPO / "docs").rglob("*.md")) if p.name != "design.md"]
    assert (REPO / "docs" / "tutorials" / "vllm.md") in pages
    hits = [f"{p.relative_to(REPO)}: {s}" for p in pages for s in _undated_commits(p.read_text(encoding="utf-8"))]
    assert not hits, hits
    assert _undated_commits("SFT 1.03x (2026-11-27, at 85d25d4)") == []
    assert _undated_commits("PPO 1.50x (2026-11-26, quiet)") and _undated_commits("norm 4.4595664 on 2026-11-27")

NOTEBOOK = re.compile(r"\bsessions?\s+\d+|第\s*\d+\s*次会话", re.I)


def _product_text_files() -> list:
    """The docs a user reads and the package's own sources: what must speak of the product."""
    files = [REPO / "README.md", REPO / "README_CN.md", REPO / "bench" / "README.md",
             *sorted((REPO / "docs").rglob("*.md"))]
    return files + sorted(p for p in PKG.rglob("*") if p.suffix in {".py", ".md", ".yaml", ".yml", ".txt", ".sh"})


def test_no_lab_notebook_numbering_in_the_docs_or_the_package():
    """A figure says its date and commit, not which work session measured it ("session 26")."""
    files = _product_text_files()
    assert len(files) > 50 and (PKG / "grpo.py") in files
    hits = [f"{p.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for p in files
            for text in [p.read_text(encoding="utf-8")] for m in NOTEBOOK.finditer(text)]
    assert not hits, hits
    assert NOTEBOOK.search("measured 2026-11-27 (Session 26)") and NOTEBOOK.search("on session\n25's quiet day")
    assert NOTEBOOK.search("（2026-11-29，第 30 次会话）") and not NOTEBOOK.search("one session, 26 steps")


def test_the_readmes_are_a_front_door_in_step():
    """README.md and README_CN.md stay short (the rest lives in the docs pages) and have the same sections."""
    sections = {}
    for name in ("README.md", "README_CN.md"):
        text = (REPO / name).read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 250, name
        sections[name] = re.findall(r"^## ", text, flags=re.M)
        for page in ("docs/getting-started.md", "docs/tutorials/grpo-gsm8k.md", "docs/benchmarks.md"):
            assert f"]({page})" in text, (name, page)
    assert len(sections["README.md"]) == len(sections["README_CN.md"]) >= 7


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300)


def test_the_docs_site_builds_strictly(tmp_path):
    """``mkdocs build --strict`` (mkdocs-material, the ``test`` extra): every page in the nav, every link and anchor
    found; the home page and a tutorial are written with the step picture."""
    proc = _mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_flow.png" in (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert (tmp_path / "site" / "tutorials" / "pipeline" / "index.html").is_file()
    assert (tmp_path / "site" / "images" / "step_flow.png").is_file()


def test_a_broken_link_fails_the_docs_build(tmp_path):
    """The strict build is a check: a copy of the site with one link to a missing page does not build."""
    import shutil

    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "how-to" / "evaluation.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [a page that is not there](missing.md).\n",
                    encoding="utf-8")
    proc = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0 and "missing.md" in proc.stderr, proc.stderr[-2000:]


def test_the_step_picture_is_drawn_from_its_source(tmp_path):
    """docs/images/step_flow.png comes from docs/figures/step_flow.py: the script draws the picture the docs show."""
    out = tmp_path / "step_flow.png"
    proc = subprocess.run([sys.executable, str(REPO / "docs" / "figures" / "step_flow.py"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    for page in ("index.md", "design.md", "tutorials/rollout.md"):
        assert "images/step_flow.png" in (REPO / "docs" / page).read_text(encoding="utf-8"), page


ISSUE_NUMBER = re.compile(r"(?<![\w&#/])#\d{1,3}\b|\bissues? #?\d+\b", re.I)


def test_no_issue_numbers_in_the_docs_help_comments_or_test_names():
    """A reader cannot look up a tracker number: docs, help strings, comments and test names say what they mean."""
    # Hidden folders are environments and caches (bench/.venv-trl, which bench/README.md has one create), not ours.
    code = [p for root in ("tests", "bench", "examples", "scripts") for p in sorted((REPO / root).rglob("*"))
            if p.suffix in {".py", ".sh", ".md"} and p.is_file() and "data" not in p.relative_to(REPO).parts[1:2]
            and not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
    files = _product_text_files() + code
    assert (REPO / "bench" / "matmul.py") in files and Path(__file__) in files
    hits = [f"{p.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for p in files
            for text in [p.read_text(encoding="utf-8")] for m in ISSUE_NUMBER.finditer(text)]
    assert not hits, hits
    hash_ = "#"
    assert ISSUE_NUMBER.search(f"(issue {hash_}43)") and ISSUE_NUMBER.search(f"the LoRA work ({hash_}44)")
    assert not ISSUE_NUMBER.search("#### 72") and not ISSUE_NUMBER.search('color="#1f77b4"')
