"""Real GSM8K preference pairs from a model's own mistakes (``mindrlhf-data --pairs``).

For each question the model samples ``k`` completions with the training prompt (``evaluate``'s
``maj`` mode: the same prompt, sampler and answer extraction as the GSM8K evaluation); the reference
solution (its ``<<calculator>>`` notes removed, ending in ``#### <number>``) is the chosen answer and
each completion whose final answer is not the reference's (wrong, or none found) a rejected one.
Questions the model always answers right give no pair. Written in ReaL's pair format, one row per
question: ``{"prompt": <the prompt text>, "pos_answers": [ref, ...], "neg_answers": [wrong, ...]}``,
which ``mindrlhf-rm`` and ``mindrlhf-dpo`` read (the EOS is appended to each answer when read).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from mindrlhf.data.gsm8k import build_prompt, strip_calculator_notes, style_system_prompt
from mindrlhf.errors import MindRLHFError
from mindrlhf.evaluation.gsm8k_eval import add_vllm_arguments, evaluate, load_questions, vllm_options
from mindrlhf.resources import GSM8K_TRAIN_SAMPLE
from mindrlhf.utils.cli import run_cli

log = logging.getLogger("mindrlhf")


def make_pairs(output: os.PathLike, *, model: Any = None, data_path: Optional[os.PathLike] = None, k: int = 4,
               max_pairs_per_question: int = 0, limit: int = 0, offset: int = 0, max_new_tokens: int = 256,
               temperature: float = 1.0, seed: int = 0, prompt_style: str = "gsm8k", overwrite: bool = False,
               progress: bool = True, **model_args: Any) -> Dict[str, Any]:
    """Sample ``k`` completions per question with ``model`` and write the pairs to ``output`` (jsonl);
    returns counts (questions, questions with a pair, pairs, the model's sample accuracy).
    ``model_args``: ``evaluate``'s model and tokenizer options (``tokenizer_dir``, ``dtype``, ...)."""
    if k < 1:
        raise MindRLHFError(f"--k {k}: sample at least one completion per question")
    if not (isinstance(temperature, (int, float)) and temperature > 0):  # evaluate's maj mode would name --mode
        raise MindRLHFError(f"--temperature {temperature!r}: pairs come from sampled completions; use a "
                            f"temperature > 0 (default 1.0)")
    output = Path(output)
    if output.exists() and not overwrite:
        raise MindRLHFError(f"{output} exists; pass --overwrite to replace it, or choose another --output")
    data = Path(data_path) if data_path is not None else GSM8K_TRAIN_SAMPLE  # pairs train: never the test split
    samples = output.with_name(output.name + ".samples.jsonl")
    summary = evaluate(model, data_path=data, limit=limit, offset=offset, mode="maj", k=k, temperature=temperature,
                       max_new_tokens=max_new_tokens, seed=seed, prompt_style=prompt_style, output=samples,
                       overwrite=True, progress=progress, progress_label=f"pairs: {k} answers a question",
                       **model_args)
    # The reference solutions of the questions used, by line (row) number: read as evaluate read them (any row
    # format), and only as far as it read (rows past --limit may be anything: malformed, not UTF-8).
    answers = {q.line: q.answer for q in load_questions(data, limit=limit, offset=offset)[0]}
    from mindrlhf.tokenizer import resolve_tokenizer

    tokenizer = resolve_tokenizer(summary["model"], model_args.get("tokenizer_dir"), model_args.get("vocab_path"),
                                  model_args.get("merges_file_path"))
    system_prompt = style_system_prompt(prompt_style)
    rows, pairs = [], 0
    for line in samples.read_text(encoding="utf-8").splitlines():
        result = json.loads(line)
        wrong = [c for c, ok in zip(result["completions"], result["sample_correct"]) if not ok and c.strip()]
        if max_pairs_per_question:
            wrong = wrong[:max_pairs_per_question]
        if not wrong:
            continue
        reference = strip_calculator_notes(answers[result["line"]])
        rows.append({"prompt": build_prompt(result["question"], tokenizer, system_prompt),
                     "pos_answers": [reference] * len(wrong), "neg_answers": wrong,
                     "question_index": result["index"]})
        pairs += len(wrong)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, output)
    samples.unlink()
    out = {"questions": summary["num_questions"], "questions_with_pairs": len(rows), "pairs": pairs,
           "sample_accuracy": summary["sample_accuracy"], "output": str(output)}
    log.info("%s: %d pairs from %d of %d questions (the model's sample accuracy %.3f)", output, pairs, len(rows),
             summary["num_questions"], summary["sample_accuracy"])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindrlhf-data --pairs", description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="the pairs jsonl to write (ReaL's prompt/pos_answers/neg_answers)")
    p.add_argument("--model", default=None, help="HF dir, .ckpt, or a training checkpoint folder (default: the "
                   "embedded SmolLM2)")
    p.add_argument("--data_path", default=None, help="GSM8K question/answer rows: a JSONL file, a .parquet file or a "
                   "datasets save_to_disk folder, verl's GSM8K layout included (default: the packaged training "
                   "sample)")
    p.add_argument("--k", type=int, default=4, help="completions sampled per question (default 4)")
    p.add_argument("--max_pairs_per_question", type=int, default=0, help="keep at most N wrong completions per "
                   "question (0 = all)")
    p.add_argument("--limit", type=int, default=0, help="questions to use (0 = all)")
    p.add_argument("--offset", type=int, default=0, help="skip this many questions first")
    p.add_argument("--max_new_tokens", type=int, default=256, help="longest completion in tokens (default 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--prompt_style", default="gsm8k", choices=("gsm8k", "tags"), help="system prompt style")
    p.add_argument("--tokenizer_dir", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--dtype", default="float32", help="compute dtype (float32, float16; bfloat16 on Ascend)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    add_vllm_arguments(p)
    return p


def _main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = build_parser().parse_args(argv)
    result = make_pairs(a.output, model=a.model, data_path=a.data_path, k=a.k,
                        max_pairs_per_question=a.max_pairs_per_question, limit=a.limit, offset=a.offset,
                        max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed,
                        prompt_style=a.prompt_style, overwrite=a.overwrite, progress=not a.no_progress,
                        tokenizer_dir=a.tokenizer_dir, dtype=a.dtype, vllm=vllm_options(a))
    print(json.dumps(result))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``mindrlhf-data --pairs``."""
    return run_cli(_main, argv)
