"""Shared fixtures: the data folder next to the checkout, MindSpore on CPU, tiny HF models."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def _shared_data() -> Path:
    env = os.environ.get("MINDRLHF_DATA_DIR")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (or ``$MINDRLHF_DATA_DIR``): GSM8K jsonl and the Qwen2.5 tokenizer."""
    path = _shared_data()
    if not (path / "gsm8k" / "test.jsonl").is_file():
        raise RuntimeError(f"test data not found at {path}; set MINDRLHF_DATA_DIR to the shared data folder")
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(shared_data: Path) -> Path:
    return shared_data / "qwen2.5-tokenizer"


@pytest.fixture(scope="session", autouse=True)
def _mindspore_cpu():
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_qwen2

    return make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
