"""Shared fixtures: the test data the repository carries, MindSpore on CPU, tiny HF models."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Helper modules here (grpo_runs, e2e_rewards, ...) import by name: pytest.ini's pythonpath puts tests/ first.
REPO = Path(__file__).resolve().parents[1]


# The repository carries its test data (GSM8K train/test, MIT; the Qwen2.5 tokenizer, Apache-2.0):
# a fresh clone runs the suite with nothing beside it. MINDRLHF_DATA_DIR points at another folder of
# the same layout (gsm8k/{train,test}.jsonl, qwen2.5-tokenizer/).
TEST_DATA = REPO / "tests" / "data"


def _data_dir() -> Path:
    env = os.environ.get("MINDRLHF_DATA_DIR")
    return Path(env).expanduser() if env else TEST_DATA


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """``tests/data`` (or ``$MINDRLHF_DATA_DIR``): GSM8K jsonl and the Qwen2.5 tokenizer."""
    path = _data_dir()
    for needed in ("gsm8k/train.jsonl", "gsm8k/test.jsonl", "qwen2.5-tokenizer/vocab.json"):
        if not (path / needed).is_file():
            raise RuntimeError(f"test data: {path / needed} not found; unset MINDRLHF_DATA_DIR to use "
                               f"{TEST_DATA}, or point it at a folder with gsm8k/ and qwen2.5-tokenizer/")
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(data_dir: Path) -> Path:
    return data_dir / "qwen2.5-tokenizer"


@pytest.fixture(scope="session", autouse=True)
def _mindspore_cpu():
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    from mindrlhf.testing import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from mindrlhf.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def grpo_assets(tmp_path_factory, qwen_tokenizer_dir, data_dir) -> dict:
    """A tiny Qwen2 with the real tokenizer and a 16-prompt GSM8K mindrecord (``grpo_runs``)."""
    from grpo_runs import make_grpo_assets

    return make_grpo_assets(tmp_path_factory.mktemp("grpo"), qwen_tokenizer_dir, data_dir)


@pytest.fixture(scope="session")
def ppo_assets(grpo_assets, tmp_path_factory, qwen_tokenizer_dir) -> dict:
    """``grpo_assets`` (the tiny actor, the 16-prompt GSM8K mindrecord) and ``rm``: a tiny one-label reward model with
    the same vocabulary. PPO's inputs, and the models the stage-safety and one-line-error tests give every stage."""
    from mindrlhf.testing import add_tokenizer, make_tiny_reward_model

    rm = make_tiny_reward_model(tmp_path_factory.mktemp("reward_model") / "rm", hidden_size=32, intermediate_size=64,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, seed=7)
    return {**grpo_assets, "rm": add_tokenizer(rm, qwen_tokenizer_dir)}


# -- file order ---------------------------------------------------------------------------------------
def pytest_collection_modifyitems(config, items):
    """Files with the most ``slow`` tests first (within a file, and among files of equal count, the order is kept).
    scripts/test.sh hands whole files to two xdist workers in this order (``--dist loadfile
    --no-loadscope-reorder``): the long files start early and the many quick ones fill the end, so one worker does
    not finish a long file alone while the other idles (xdist's own order, by number of tests, put the files of a
    few long tests last)."""
    slow: dict = {}
    for item in items:
        if item.get_closest_marker("slow"):
            slow[item.path] = slow.get(item.path, 0) + 1
    # The vLLM file first: its engines start (in processes of their own) while the msrun launches run beside it.
    items.sort(key=lambda item: (item.get_closest_marker("vllm") is None, -slow.get(item.path, 0)))


# -- memory report ------------------------------------------------------------------------------------
# The suite runs most tests in one process; MindSpore keeps compiled graphs and its memory pools for the
# process's life, so an in-process test can leave gigabytes behind (a CI run once reached 12.7 GB beside
# another job and was killed). Like --durations for time, the summary names the tests that raised the
# process's peak RSS and those that left the most resident memory behind.
_MEM_TOP = 10
_mem: dict = {"peak": {}, "kept": {}}


def _rss_gib() -> float:
    """This process's resident set now (GiB), from /proc (Linux); 0 elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return 0.0


def _peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    peak, rss = _peak_gib(), _rss_gib()
    yield
    _mem["peak"][item.nodeid] = _peak_gib() - peak
    _mem["kept"][item.nodeid] = _rss_gib() - rss


def pytest_terminal_summary(terminalreporter):
    if not _mem["peak"]:
        return
    tr = terminalreporter
    tr.write_sep("=", f"memory: pytest process peak RSS {_peak_gib():.2f} GiB, resident now {_rss_gib():.2f} GiB")
    for key, what in (("peak", "raised the peak RSS by"), ("kept", "left resident")):
        top = sorted(_mem[key].items(), key=lambda kv: -kv[1])[:_MEM_TOP]
        for nodeid, gib in top:
            if gib >= 0.05:
                tr.write_line(f"{what} {gib:6.2f} GiB  {nodeid}")


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    """The Qwen2.5 tokenizer (its chat template renders tools)."""
    from mindrlhf.tokenizer import Tokenizer

    return Tokenizer.from_dir(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def calc():
    """The built-in calculator as a rollout's tools, 5 s a call."""
    from mindrlhf.rollout_tools import ToolBox

    return ToolBox(["calculator"], timeout=5)
