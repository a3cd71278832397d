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
