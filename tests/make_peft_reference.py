"""Records tests/data/peft_reference.json: peft's logits of tiny Qwen2 / Llama / Qwen3 models with a random adapter.

Runs in the bench virtualenv that has torch, transformers and peft (bench/.venv-trl or $MINDRLHF_TRL_VENV; peft is
not a dependency of mindrlhf). It never imports the ``mindrlhf`` package: the models come from ``mindrlhf/testing.py``
loaded by its path (``make_numpy_tiny``: every weight drawn with numpy, so both virtualenvs build byte-identical
models; checksums are recorded), and so do the adapters (``lora_numpy_init``: A and B both non-zero).

For each family: the base model is wrapped by ``peft.get_peft_model`` with ``ADAPTERS[family]``'s LoraConfig,
its lora_A / lora_B weights are set to the numpy arrays, and the logits of a padded batch are recorded, with
what ``save_pretrained`` wrote (``adapter_config.json`` as written, the checksum of ``adapter_model.safetensors``'
tensors). tests/test_lora.py checks that mindrlhf reads that directory and writes the same one, and gets
these logits.

    bench/.venv-trl/bin/python tests/make_peft_reference.py [--output tests/data/peft_reference.json]
    bench/.venv-trl/bin/python tests/make_peft_reference.py --family qwen2 --adapter_dir DIR --output logits.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any, Dict

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

VOCAB = 128  # a small vocabulary keeps the recorded logits small
MODEL_SEED, ADAPTER_SEED = 5, 6
#: family -> LoraConfig kwargs: names, a regex, rsLoRA; alpha != r so the scaling is tested.
ADAPTERS: Dict[str, Dict[str, Any]] = {
    "qwen2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]),
    "llama": dict(r=2, lora_alpha=5, target_modules=r".*\.(q_proj|v_proj|down_proj)"),
    "qwen3": dict(r=8, lora_alpha=4, target_modules=["q_proj", "o_proj", "up_proj"], use_rslora=True),
}
#: input ids (one row left-padded) and mask
IDS = [[0, 0, 17, 99, 3, 45, 120], [7, 8, 9, 100, 101, 64, 33]]
MASK = [[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]


def load_testing_module():
    """``mindrlhf/testing.py`` by its path (the package, which needs MindSpore, is not imported)."""
    spec = importlib.util.spec_from_file_location("mindrlhf_testing_standalone", REPO / "mindrlhf" / "testing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peft_logits(model) -> Any:
    """float32 logits of ``IDS`` under ``MASK``, positions counting real tokens (as mindrlhf's do)."""
    import numpy as np
    import torch

    mask = np.array(MASK)
    pos = np.clip(mask.cumsum(1) - 1, 0, None)
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(pos)).logits.float().numpy()


def _base(testing, family: str, root: Path):
    import torch
    from transformers import AutoModelForCausalLM

    path = testing.make_numpy_tiny(root / family, family, seed=MODEL_SEED, vocab_size=VOCAB)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def record_family(testing, family: str, root: Path) -> Dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.numpy import load_file

    path, base = _base(testing, family, root)
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **ADAPTERS[family])).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:  # base_model.model.<name>.lora_A.default.weight -> <name>.lora_A.weight
                key = name[len("base_model.model."):].replace(".default.", ".")
                param.copy_(torch.from_numpy(testing.lora_numpy_init(key, param.shape, ADAPTER_SEED)))
    logits = peft_logits(model)
    out = root / f"{family}_adapter"
    model.save_pretrained(out)
    config = json.loads((out / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = None  # a temporary path
    if isinstance(config["target_modules"], list):  # peft keeps a set: its order changes from run to run
        config["target_modules"] = sorted(config["target_modules"])
    return {"model": testing.weights_checksum(path), "lora_config": ADAPTERS[family], "adapter_config": config,
            "adapter": testing.array_checksum(load_file(str(out / "adapter_model.safetensors"))),
            "logits": [[[float(f"{v:.8g}") for v in row] for row in seq] for seq in logits.tolist()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(HERE / "data" / "peft_reference.json"))
    parser.add_argument("--family", choices=sorted(ADAPTERS), help="with --adapter_dir: only peft's logits")
    parser.add_argument("--adapter_dir", help="a PEFT adapter dir (e.g. written by mindrlhf) to load onto the base")
    args = parser.parse_args()

    import numpy as np
    import peft
    import torch
    import transformers

    testing = load_testing_module()
    with tempfile.TemporaryDirectory() as tmp:
        if args.adapter_dir:
            from peft import PeftModel

            _, base = _base(testing, args.family, Path(tmp))
            model = PeftModel.from_pretrained(base, args.adapter_dir).eval()
            result: Dict[str, Any] = {"logits": peft_logits(model).tolist()}
        else:
            result = {"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                      "numpy": np.__version__, "made_by": "tests/make_peft_reference.py", "ids": IDS, "mask": MASK,
                      "vocab": VOCAB, "model_seed": MODEL_SEED, "adapter_seed": ADAPTER_SEED,
                      "families": {f: record_family(testing, f, Path(tmp)) for f in ADAPTERS}}
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
