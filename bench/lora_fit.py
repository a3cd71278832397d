"""Which model sizes a full fine-tune and a LoRA run fit on this machine: peak RSS of two SFT steps.

    python bench/lora_fit.py                                  # Qwen2.5-0.5B, 1.5B and 3B shapes, full and LoRA
    python bench/lora_fit.py --sizes 0.5b --modes full,lora   # one size
    python bench/lora_fit.py --sizes tiny                     # a quick check of the script (seconds)

Each (size, mode) runs ``mindrlhf-sft`` in its own child process (``python -m mindrlhf.sft``, the command a
user runs) for ``--steps`` steps and reports that child's peak RSS (``wait4``'s ``ru_maxrss``) and its step
times. The models are Qwen2.5's published shapes (hidden size, layers, heads, the 151,936-row vocabulary, tied
embeddings as Qwen2.5 up to 3B ties them) with random weights, written once per size as a bfloat16
safetensors file under ``--work`` (the loader widens them to float32, the CPU compute dtype) beside the Qwen2.5
tokenizer that tests/data carries. The job: the first 8 questions of the packaged GSM8K sample as
conversational SFT rows (system prompt + question -> reference solution, ~200-300 tokens a row), batch 8,
micro-batch ``--micro_batch_size``, recompute full (what ``recompute auto`` picks at these sizes), float32.
LoRA: rank 16, alpha 32, every attention and MLP projection (the default targets).

A full fine-tune keeps float32 weights, gradients and AdamW's two moments: 16 bytes a parameter before any
activation. A size whose 16 bytes a parameter exceed the machine's available memory is not launched (it would
be killed by the kernel, or take the machine down with it): the row says so with the bytes it would need.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TOKENIZER = REPO / "tests" / "data" / "qwen2.5-tokenizer"

#: Qwen2.5's published shapes (config.json of Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}); ``tiny`` checks the script.
SIZES: Dict[str, Dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
}
VOCAB = 151936
#: float32 weights, gradients and AdamW's two moments: a full fine-tune's state per parameter.
FULL_BYTES_PER_PARAM = 16
LORA = ["--lora_rank", "16", "--lora_alpha", "32"]


def qwen2_tensors(shape: Dict[str, Any]) -> List[tuple]:
    """``(name, shape)`` of every tensor of a ``Qwen2ForCausalLM`` with ``shape``'s sizes (HF names)."""
    h, inter, heads, kv = (shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"],
                           shape["num_key_value_heads"])
    d = h // heads
    out = [("model.embed_tokens.weight", (VOCAB, h)), ("model.norm.weight", (h,))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (heads * d, h)), (p + "self_attn.q_proj.bias", (heads * d,)),
                (p + "self_attn.k_proj.weight", (kv * d, h)), (p + "self_attn.k_proj.bias", (kv * d,)),
                (p + "self_attn.v_proj.weight", (kv * d, h)), (p + "self_attn.v_proj.bias", (kv * d,)),
                (p + "self_attn.o_proj.weight", (h, heads * d)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    if not shape["tie_word_embeddings"]:
        out.append(("lm_head.weight", (VOCAB, h)))
    return out


def num_params(shape: Dict[str, Any]) -> int:
    """Parameters of the model (a tied head counted once)."""
    return int(sum(np.prod(s) for _, s in qwen2_tensors(shape)))


def write_model(size: str, root: Path) -> Path:
    """A random ``size`` Qwen2.5-shaped model folder (bfloat16 safetensors, config.json, the tokenizer)."""
    from mindrlhf.checkpoint.hf_io import StreamingSafetensorsWriter, cast_for_storage
    from mindrlhf.testing import add_tokenizer

    shape = SIZES[size]
    folder = root / f"qwen2.5-{size}-random"
    if (folder / "model.safetensors").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    writer = StreamingSafetensorsWriter(folder / "model.safetensors", {"format": "pt"})
    for name, dims in qwen2_tensors(shape):
        if name.endswith("norm.weight"):
            x = np.ones(dims, np.float32)
        else:  # N(0, 1/fan_in): a finite, non-degenerate forward
            x = rng.standard_normal(dims, dtype=np.float32) / np.float32(np.sqrt(dims[-1]))
        writer.add(name, cast_for_storage(x, "bfloat16"), "bfloat16")
    writer.close()
    config = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=VOCAB,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
                  torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645, **shape)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    add_tokenizer(folder, TOKENIZER)
    return folder


def write_rows(path: Path, rows: int) -> Path:
    """The first ``rows`` questions of the packaged GSM8K sample as conversational SFT rows."""
    import mindrlhf.resources
    from mindrlhf.data.gsm8k import sft_row

    source = Path(mindrlhf.resources.__file__).parent / "gsm8k_train_sample.jsonl"
    lines = [json.loads(x) for x in source.read_text(encoding="utf-8").splitlines() if x.strip()][:rows]
    path.write_text("".join(json.dumps(sft_row(r["question"], r["answer"])) + "\n" for r in lines), encoding="utf-8")
    return path


def available_gib() -> float:
    """Memory the kernel says a new process can take (``MemAvailable``), GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2 ** 20
    return float("nan")


def run_sft(model: Path, rows: Path, out: Path, args: argparse.Namespace, lora: bool) -> Dict[str, Any]:
    """``python -m mindrlhf.sft`` in a child; its peak RSS (GiB), wall seconds, per-step seconds, exit code."""
    cmd = [sys.executable, "-m", "mindrlhf.sft", "--model", str(model), "--train_file", str(rows),
           "--output_dir", str(out), "--max_steps", str(args.steps), "--batch_size", "8",
           "--micro_batch_size", str(args.micro_batch_size), "--max_length", "512", "--recompute", "full",
           "--save_steps", str(10 ** 6), "--progress_bar", "false", "--tensorboard", "false",
           *(LORA if lora else [])]
    shutil.rmtree(out, ignore_errors=True)  # this bench's own folder from an earlier invocation
    t0 = time.perf_counter()
    with open(out.parent / (out.name + ".log"), "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    steps = []
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        steps = [json.loads(x).get("step_time") for x in metrics.read_text().splitlines() if x.strip()]
    return {"peak_rss_gib": usage.ru_maxrss / 2 ** 20, "wall_s": wall, "step_s": steps,
            "exit": os.waitstatus_to_exitcode(status)}


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.5b,1.5b,3b", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--modes", default="full,lora", help="comma-separated, of full, lora")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--work", default=str(BENCH / ".lora_fit"), help="models and run outputs (large: ~2 GiB a "
                   "billion parameters)")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = write_rows(work / "sft_rows.jsonl", 8)
    total = available_gib()
    print(f"machine: {os.cpu_count()} cores, {total:.1f} GiB available now")
    results = []
    for size in args.sizes.split(","):
        params = num_params(SIZES[size])
        model = None
        for mode in args.modes.split(","):
            need = params * FULL_BYTES_PER_PARAM / 2 ** 30 if mode == "full" else params * 4 / 2 ** 30
            row = {"size": size, "params": params, "mode": mode, "state_gib": need}
            if need > available_gib():
                what = "weights, gradients and AdamW moments" if mode == "full" else "float32 weights"
                row["skipped"] = f"needs >= {need:.1f} GiB for its {what} alone; {available_gib():.1f} GiB available"
            else:
                model = model or write_model(size, work)
                row.update(run_sft(model, rows, work / f"{size}-{mode}", args, mode == "lora"))
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'size':6} {'params':>8} {'mode':5} {'state':>9} {'peak RSS':>9} {'step s':>8}  note")
    for r in results:
        steps = [s for s in r.get("step_s", []) if s]
        print(f"{r['size']:6} {r['params'] / 1e9:7.2f}B {r['mode']:5} {r['state_gib']:8.1f}G "
              f"{r.get('peak_rss_gib', float('nan')):8.2f}G {steps[-1] if steps else float('nan'):8.1f}  "
              f"{r.get('skipped') or ('exit ' + str(r['exit']) if r.get('exit') else '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
