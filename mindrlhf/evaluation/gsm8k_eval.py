"""GSM8K evaluation: greedy pass@1 or sampled majority vote (maj@k) with the native sampler.

    mindrlhf-eval [--model PATH] [--limit 64] [--mode greedy|maj --k 8] [--output results.jsonl]
    python -m mindrlhf.evaluation.gsm8k_eval ...

Prompts are built exactly as for training (``mindrlhf.data.gsm8k.build_prompt`` with the training
system prompt and the tokenizer's chat template), completions are decoded as the trainer decodes
them (special tokens skipped) and a question is correct when the built-in ``accuracy`` reward gives
its predicted completion 1.0. Greedy: the one completion is the prediction. maj@k: ``k`` sampled
completions vote with their extracted answers, compared numerically (``parse_number`` +
``numbers_match``); the answer with most votes wins, ties going to the one that appeared first, and
the first completion giving that answer is scored.

``evaluate(...)`` returns the summary as a dict, for scripts and training hooks; it takes a model
path, a loaded ``CausalLM`` or a ready ``Sampler`` (so a trainer can reuse its compiled graphs).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from mindrlhf.data.gsm8k import (
    DEFAULT_PROMPT_STYLE,
    PROMPT_STYLES,
    build_prompt,
    extract_gsm8k_solution,
    style_format_reward,
    style_system_prompt,
)
from mindrlhf.errors import MindRLHFError
from mindrlhf.resources import GSM8K_TEST_SAMPLE
from mindrlhf.rewards import (
    RewardManager,
    accuracy_reward,
    extract_answer,
    get_reward_fn,
    numbers_match,
    parse_number,
)
from mindrlhf.tokenizer import resolve_tokenizer
from mindrlhf.utils.cli import run_cli

if TYPE_CHECKING:
    from mindrlhf.rollout_tools import ToolBox
    from mindrlhf.rollout_tools.environment import Environment

log = logging.getLogger(__name__)

DEFAULT_DATA = GSM8K_TEST_SAMPLE
MODES = ("greedy", "maj")
DEVICE_TARGETS = ("CPU", "Ascend", "GPU")

PathLike = Union[str, os.PathLike]


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
@dataclass
class Question:
    """One GSM8K question: ``index`` counts the file's rows from 0 (the dataset index), ``line`` is the 1-based
    line number (a table's row number), ``solution`` the final answer after ``####``, ``answer`` the row's worked
    answer."""

    index: int
    line: int
    question: str
    solution: str
    answer: str = ""


def load_questions(path: PathLike, limit: int = 0, offset: int = 0) -> Tuple[List[Question], int]:
    """``(questions, skipped)`` from GSM8K-style rows (``question`` and ``answer`` fields; verl's GSM8K layout is
    read as ``data.gsm8k.question_answer_row`` maps it) in a JSONL file, a parquet file or a datasets save_to_disk
    folder (``data.row_files``).

    Rows whose answer has no ``#### N`` final answer are skipped and counted; ``offset`` and
    ``limit`` (0 = all) select among the usable questions, in file order, and reading stops once
    enough were found. Malformed JSON or a missing/empty field raises ``MindRLHFError`` naming the line.
    """
    from mindrlhf.data.gsm8k import question_answer_row
    from mindrlhf.data.row_files import ACCEPTED, open_rows

    path = Path(path)
    if not path.exists():
        raise MindRLHFError(f"data file not found: {path}; pass --data_path with GSM8K question/answer rows "
                            f"({ACCEPTED})")
    _check_count("limit", limit, 0)
    _check_count("offset", offset, 0)
    source = open_rows(path, "question")
    wanted = offset + limit if limit else None
    found: List[Question] = []
    skipped = 0
    index = 0
    for line_no, record, error, _ in source.rows():
        if wanted is not None and len(found) >= wanted:
            break
        where = f"{path} {'line' if source.format == 'jsonl' else 'row'} {line_no}"
        if error is not None:
            raise MindRLHFError(f"{where}: malformed JSON ({error}); fix or remove that line")
        if not isinstance(record, dict):
            raise MindRLHFError(f"{where}: a JSON {type(record).__name__}, not an object with "
                                f"'question' and 'answer'; fix or remove that line")
        record = question_answer_row(record)
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise MindRLHFError(f"{where}: no non-empty string field 'question'; fix or remove that line")
        if not isinstance(answer, str):
            raise MindRLHFError(f"{where}: no string field 'answer' (GSM8K's worked answer ending in "
                                f"'#### N'); fix or remove that line")
        solution = extract_gsm8k_solution(answer)
        if solution:
            found.append(Question(index, line_no, question, solution, answer))
        else:
            skipped += 1
        index += 1
    return found[offset:], skipped


def _check_count(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MindRLHFError(f"--{name} {value!r} is invalid: use an integer >= {minimum}")


# ---------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------
def majority_vote(answers: Sequence[Optional[str]]) -> Tuple[Optional[int], int]:
    """``(position, votes)`` of the winning answer among extracted answers (None = no answer).

    Answers are equal when both parse as numbers that ``numbers_match`` (``"18"``, ``"18.0"``,
    ``"$18"``), else when their whitespace/case-normalised text is equal. ``position`` is the first
    completion giving the winner: the most votes wins, and a tie goes to the answer seen first.
    ``(None, 0)`` when no completion has an answer.
    """
    groups: List[Tuple[Optional[float], str, List[int]]] = []  # (number, normalised text, members)
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        value, text = parse_number(answer), " ".join(answer.split()).lower()
        for number, norm, members in groups:
            same = (numbers_match(value, number) if value is not None and number is not None
                    else value is None and number is None and text == norm)
            if same:
                members.append(i)
                break
        else:
            groups.append((value, text, [i]))
    if not groups:
        return None, 0
    # max() returns the first maximal group, and groups are in order of first appearance.
    best = max(groups, key=lambda g: len(g[2]))[2]
    return best[0], len(best)


@dataclass
class QuestionScore:
    """Scores of one question's completions."""

    extracted_answers: List[Optional[str]]
    predicted_answer: Optional[str]
    votes: int
    correct: bool
    format_ok: List[bool]
    sample_correct: List[bool] = field(default_factory=list)


def score_question(completions: Sequence[str], solution: str,
                   prompt_style: str = DEFAULT_PROMPT_STYLE) -> QuestionScore:
    """Extract answers, vote (one completion: it wins if it has an answer) and score with the
    training rewards: ``correct`` is the ``accuracy`` reward of the winning completion, ``format_ok``
    the prompt style's format reward (``gsm8k_format`` or ``format``) of each completion."""
    texts = list(completions)
    answers = [extract_answer(t) for t in texts]
    sample_correct = [r == 1.0 for r in accuracy_reward(texts, [solution] * len(texts))]
    fmt = [r == 1.0 for r in get_reward_fn(style_format_reward(prompt_style))(texts)]
    winner, votes = majority_vote(answers)
    correct = winner is not None and sample_correct[winner]
    return QuestionScore(answers, answers[winner] if winner is not None else None, votes, bool(correct),
                         fmt, sample_correct)


def binomial_stderr(p: float, n: int) -> float:
    """Standard error ``sqrt(p (1 - p) / n)`` of an accuracy ``p`` measured on ``n`` questions."""
    return math.sqrt(p * (1.0 - p) / n) if n > 0 else float("nan")


# ---------------------------------------------------------------------------------------------
# model / tokenizer resolution
# ---------------------------------------------------------------------------------------------
def resolve_model_path(model: Optional[PathLike], progress: bool = False) -> Path:
    """The given model path (checked to exist; a training run's folder stands for its newest intact checkpoint),
    or the embedded SmolLM2-135M-Instruct."""
    if model is None or str(model) == "":
        from mindrlhf.checkpoint.smollm2 import prepare_smollm2

        return Path(prepare_smollm2(progress=progress))
    path = Path(model)
    if not path.exists():
        raise MindRLHFError(f"--model {path} not found; pass a Hugging Face model directory, a training checkpoint "
                            f"folder (checkpoints/step_N) or a MindSpore "
                            f".ckpt/.safetensors file with config.json next to it (or omit --model for SmolLM2)")
    from mindrlhf.checkpoint.run_record import model_of_run

    return model_of_run(path)  # a training run's folder: its newest intact checkpoint


def _load(model, tokenizer, batch_rows: int, progress: bool, dtype: str, jit: bool, tokenizer_args: tuple,
          use_chat_template: bool, base_model: Optional[PathLike] = None,
          vllm: Optional[Mapping[str, Any]] = None):
    """``(sampler, tokenizer, model_path)`` from a Sampler, a CausalLM, a path or None (SmolLM2);
    the tokenizer is resolved before any weights are read, so a missing one fails fast."""
    from mindrlhf.generation import Sampler
    from mindrlhf.models import CausalLM, load_model, require_causal_lm
    from mindrlhf.parallel.resharding import checkpoint_config

    answers = "the model that answers the questions"
    fix = "pass the policy (a *ForCausalLM checkpoint); a reward model scores answers, it does not write them"
    if isinstance(model, (Sampler, CausalLM)):
        if tokenizer is None:
            tokenizer = resolve_tokenizer(None, *tokenizer_args)
        _check_template(tokenizer, use_chat_template)
        if isinstance(model, Sampler):
            return model, tokenizer, None
        require_causal_lm(model.config, "(a CausalLM)", "evaluate: model", answers, fix)
        return _sampler(model, batch_rows, jit, vllm), tokenizer, None
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise MindRLHFError(f"evaluate: model must be a path, a CausalLM or a Sampler, got {type(model).__name__}")
    path = resolve_model_path(model, progress=progress)
    base, adapter = adapter_base(path, base_model)
    if adapter is not None:  # a LoRA checkpoint's adapters go on the base they were trained on
        from mindrlhf.checkpoint.hf_io import model_files
        from mindrlhf.checkpoint.manifest import check_adapter_base

        check_adapter_base(adapter, str(base), model_files(base), flag="--base_model", explicit=base_model is not None)
    require_causal_lm(checkpoint_config(base), base, "--model", answers, fix)  # before any weights are read
    if tokenizer is None:
        tokenizer = resolve_tokenizer(base, *tokenizer_args)
    _check_template(tokenizer, use_chat_template)
    loaded = load_model(base, dtype=dtype)
    if adapter is not None:  # the sampler's layers apply the adapters, as a LoRA GRPO run samples
        from mindrlhf.models.lora import load_adapter

        load_adapter(loaded, adapter)
    return _sampler(loaded, batch_rows, jit, vllm), tokenizer, path


def _sampler(model, batch_rows: int, jit: bool, vllm: Optional[Mapping[str, Any]]):
    """The native sampler over ``model``, or with ``vllm`` (``VLLMSampler``'s options) a vLLM engine holding its
    weights; prompt + completion up to the model's positions, at most 4096 tokens (the engine's KV cache)."""
    if vllm is None:
        from mindrlhf.generation import NativeSampler

        return NativeSampler(model, max_batch_size=batch_rows, jit=jit)
    from mindrlhf.generation.factory import vllm_sampler_for

    return vllm_sampler_for(model, max_model_len=min(model.config.max_position_embeddings, 4096),
                            **{"max_num_seqs": max(batch_rows, 1), **vllm})


def adapter_base(path: Path, base_model: Optional[PathLike] = None) -> Tuple[Path, Optional[Path]]:
    """``(model to load, adapter folder or None)``: a PEFT adapter folder (a LoRA run's ``adapter/`` or
    checkpoint) stands for its base (``base_model``, else adapter_config.json's ``base_model_name_or_path``)
    with the adapters on it; any other path is the model itself (``base_model`` must then be unset)."""
    from mindrlhf.checkpoint.hf_io import read_json
    from mindrlhf.models.lora import ADAPTER_CONFIG

    if not (path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()):
        if base_model is not None:
            raise MindRLHFError(f"--base_model {base_model} with --model {path}, which is a model, not a PEFT adapter "
                                "folder; drop --base_model")
        return path, None
    config = read_json(path / ADAPTER_CONFIG)
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise MindRLHFError(f"--model {path} is a {config.get('task_type')} adapter (a reward model's or critic's: "
                            "it scores answers, it does not write them); pass a policy's adapter or model")
    recorded = config.get("base_model_name_or_path")
    base = Path(base_model) if base_model is not None else Path(recorded) if recorded else None
    if base is None or not base.exists():
        where = f"its base {str(base)!r} is not there" if base is not None else "it names no base model"
        raise MindRLHFError(f"--model {path} is a LoRA adapter folder and {where}; pass the base model it was "
                            "trained on as --base_model")
    return base, path


def _check_template(tokenizer, use_chat_template: bool) -> None:
    if use_chat_template and not tokenizer.has_chat_template:
        raise MindRLHFError(f"the tokenizer from {tokenizer.source} has no chat_template; use the model's "
                            f"tokenizer_config.json, or --no_chat_template for raw questions")


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------
def evaluate(
    model: Any = None,
    tokenizer: Any = None,
    *,
    data_path: Optional[PathLike] = None,
    limit: int = 0,
    offset: int = 0,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    mode: str = "greedy",
    k: int = 8,
    temperature: float = 0.7,
    top_p: float = 1.0,
    seed: int = 0,
    prompt_style: str = DEFAULT_PROMPT_STYLE,
    system_prompt: Optional[str] = None,
    use_chat_template: bool = True,
    dtype: str = "float32",
    output: Optional[PathLike] = None,
    overwrite: bool = False,
    progress: bool = True,
    progress_label: str = "",
    tokenizer_dir: Optional[PathLike] = None,
    vocab_path: Optional[PathLike] = None,
    merges_file_path: Optional[PathLike] = None,
    stop_token_ids: Optional[Sequence[int]] = None,
    jit: bool = True,
    rewards: Optional[RewardManager] = None,
    shard: Tuple[int, int] = (0, 1),
    reduce: Optional[Callable[[np.ndarray], np.ndarray]] = None,
    base_model: Optional[PathLike] = None,
    vllm: Optional[Mapping[str, Any]] = None,
    tools: Optional["ToolBox"] = None,
    max_tool_calling_iterations: int = 5,
    environment: Optional["Environment"] = None,
) -> Dict[str, Any]:
    """Evaluate a model on GSM8K; return the summary as a dict.

    Keys: ``metric`` ("pass@1" | "maj@k"), ``accuracy`` (fraction of questions correct) and
    ``accuracy_stderr`` (binomial, ``sqrt(p(1-p)/n)``), ``correct``, ``num_questions``,
    ``sample_accuracy`` (mean accuracy reward over all completions), ``format_rate`` (fraction of
    completions the ``format`` reward scores 1), ``mean_completion_tokens``, ``truncated_rate``,
    ``wall_time_s`` (generation + scoring), ``load_time_s``, ``compile_time_s``, ``tokens_per_s``,
    ``skipped_rows``, ``rewards`` (each reward function's mean over all completions, by name; NaN where it
    scored none) and the settings used.

    ``rewards``: the reward functions to average (a ``RewardManager``, called as training calls it, with the
    question and its solution as columns); default: the built-in ``accuracy`` and the prompt style's format
    reward, as the training defaults, and ``environment`` with an environment that has ``get_reward``.

    ``shard`` ``(i, n)`` and ``reduce``: data-parallel evaluation. Replica ``i`` of ``n`` evaluates batches ``i``,
    ``i + n``, ... (a batch, its seed and its padding are the unsharded run's, so each question gets the same
    completions), and ``reduce`` sums the replicas' counts (a float64 vector of correct answers, completions,
    tokens, ... and each reward function's sum and count) before the rates are formed: the summary is the
    unsharded one's on every replica. ``output`` needs ``n`` = 1.

    ``vllm``: sample with a vLLM engine instead of the native sampler (``VLLMSampler``'s options: ``python``,
    ``dtype``, ``server``; ``{}`` for the defaults), started for this evaluation and stopped after it (a served
    one keeps running).

    ``tools``: the tools the model may call (a ``rollout_tools.ToolBox``), shown in every prompt through the chat
    template and answered by the rollout's own loop (``generation.tool_loop``, at most
    ``max_tool_calling_iterations`` rounds), as a GRPO run with those tools samples; the summary then has
    ``tool_call_frequency`` (calls per completion), ``tool_failure_frequency`` (failed calls per call) and
    ``turns_mean``, and ``mean_completion_tokens`` counts the model's tokens only. ``environment``
    (``rollout_tools.environment.Environment``): an instance per completion, reset with its question and solution,
    whose methods are tools too and whose ``get_reward()`` the ``environment`` reward function scores.

    ``model`` may be a LoRA run's PEFT adapter folder: its base (``base_model``, else the one its
    adapter_config.json records) is loaded and the adapters applied (``adapter_base``).

    ``model``: an HF dir / MindSpore checkpoint path (None = the embedded SmolLM2), a ``CausalLM``
    or a ``Sampler``. ``tokenizer``: a ``Tokenizer``, else from ``tokenizer_dir``/``vocab_path`` or the
    model's folder. ``mode``: ``"greedy"`` (pass@1, temperature 0) or ``"maj"`` (``k`` samples at
    ``temperature``/``top_p``, majority vote). Stop tokens default to the tokenizer's, as in
    training. ``batch_size`` questions go to the sampler per call; with sampling, call ``i`` uses
    seed ``seed`` mixed with its first question's index, so results depend on (seed, batch_size, offset).
    ``output``: per-question JSONL (written to ``<output>.tmp`` per batch, renamed when done); an
    existing file is an error unless ``overwrite``. ``progress_label``: the progress bar's label (default
    ``gsm8k <mode>``; a caller that samples for another purpose names it).
    The device must be set up by the caller (the CLI does it).
    """
    from tqdm import tqdm

    from mindrlhf.generation import SamplingParams

    if mode not in MODES:
        raise MindRLHFError(f"--mode {mode!r} is invalid: use one of {', '.join(MODES)}")
    _check_count("batch_size", batch_size, 1)
    _check_count("max_new_tokens", max_new_tokens, 1)
    _check_count("k", k, 1)
    if mode == "maj" and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise MindRLHFError(f"--temperature {temperature!r} with --mode maj: majority voting needs sampling, use "
                            f"a temperature > 0 (or --mode greedy)")
    if mode == "maj" and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise MindRLHFError(f"--top_p {top_p!r} is invalid: use a value in (0, 1] (1 = off)")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise MindRLHFError(f"--seed {seed!r} is invalid: use an integer")
    replica, replicas = shard
    if not 0 <= replica < replicas:
        raise MindRLHFError(f"evaluation shard {replica} of {replicas} does not exist: use 0 <= shard < shards")
    if replicas > 1 and output is not None:
        raise MindRLHFError("a per-question output file needs the whole evaluation in one process; evaluate with one "
                            "replica (shard (0, 1)) to write --output")
    n = k if mode == "maj" else 1
    data = Path(data_path) if data_path is not None else DEFAULT_DATA
    questions, skipped = load_questions(data, limit=limit, offset=offset)
    inputs = {"--data_path": data, "--model": model, "--tokenizer_dir": tokenizer_dir, "--vocab_path": vocab_path,
              "--merges_file_path": merges_file_path}
    out_path = _check_output(output, inputs, overwrite) if output is not None else None
    if skipped:
        log.warning("%s: skipped %d rows without a '#### N' final answer", data, skipped)
    if not questions:
        raise MindRLHFError(f"{data}: no questions to evaluate (offset {offset}, {skipped} rows skipped); "
                            f"check --data_path/--offset")

    t_load = time.perf_counter()
    sampler, tokenizer, model_path = _load(model, tokenizer, batch_size * n, progress, dtype, jit,
                                           (tokenizer_dir, vocab_path, merges_file_path), use_chat_template, base_model,
                                           vllm)
    started = sampler if vllm is not None and sampler is not model else None  # stopped when done (or by the GC)
    stops = list(stop_token_ids) if stop_token_ids is not None else list(tokenizer.stop_token_ids)
    if system_prompt is None:
        system_prompt = style_system_prompt(prompt_style)
    loop = _tool_loop(tools, environment, tokenizer, max_tool_calling_iterations, use_chat_template)
    schemas = loop.schemas if loop is not None else None
    prompts = tokenizer.encode_batch([build_prompt(q.question, tokenizer, system_prompt, use_chat_template, schemas)
                                      for q in questions])
    if rewards is None:  # the training defaults, and an environment's own reward
        rewards = RewardManager(["accuracy", style_format_reward(prompt_style)]
                                + (["environment"] if environment is not None and environment.has_reward else []))
    reward_sums = {name: [0.0, 0] for name in rewards.names}  # sum and count of the scores given (not None)
    load_s = time.perf_counter() - t_load

    correct = sample_correct = format_ok = completions_total = tokens_total = truncated = 0
    tool_calls = tool_failures = turns = 0
    compile_s = 0.0
    tmp = out_path.with_name(out_path.name + ".tmp") if out_path is not None else None
    sink = open(tmp, "w", encoding="utf-8") if tmp is not None else None
    t0 = time.perf_counter()
    try:
        starts = range(replica * batch_size, len(questions), replicas * batch_size)
        with tqdm(total=sum(min(batch_size, len(questions) - s) for s in starts), desc=progress_label or
                  f"gsm8k {mode}", unit="q", disable=not progress, file=sys.stderr) as bar:
            seen = 0
            for start in starts:
                batch = questions[start:start + batch_size]
                params = SamplingParams(
                    n=n, temperature=0.0 if mode == "greedy" else float(temperature),
                    top_p=1.0 if mode == "greedy" else top_p, max_tokens=max_new_tokens,
                    stop_token_ids=stops, seed=(seed * 1_000_003 + batch[0].index) % (2 ** 63))
                done = (loop.generate(sampler, prompts[start:start + len(batch)], params,
                                      rows=[{"question": q.question, "solution": q.solution} for q in batch])
                        if loop is not None else sampler.generate(prompts[start:start + len(batch)], params))
                compile_s += float(getattr(sampler, "last_stats", {}).get("compile_s", 0.0))
                texts = tokenizer.batch_decode([c.token_ids for c in done], skip_special_tokens=True)
                _add_rewards(reward_sums, rewards, texts, batch, n, tokenizer.batch_decode(
                    prompts[start:start + len(batch)], skip_special_tokens=False), done)
                for j, q in enumerate(batch):
                    mine = done[j * n:(j + 1) * n]
                    score = score_question(texts[j * n:(j + 1) * n], q.solution, prompt_style)
                    correct += score.correct
                    sample_correct += sum(score.sample_correct)
                    format_ok += sum(score.format_ok)
                    completions_total += n
                    tokens_total += sum(_policy_tokens(c) for c in mine)
                    truncated += sum(c.finish_reason == "length" for c in mine)
                    tool_calls += sum(c.tool_calls for c in mine)
                    tool_failures += sum(c.tool_failures for c in mine)
                    turns += sum(c.turns for c in mine)
                    if sink is not None:
                        sink.write(json.dumps({
                            "index": q.index, "line": q.line, "question": q.question, "solution": q.solution,
                            "completions": texts[j * n:(j + 1) * n],
                            "extracted_answers": score.extracted_answers,
                            "predicted_answer": score.predicted_answer, "votes": score.votes,
                            "correct": score.correct, "format_ok": score.format_ok,
                            "sample_correct": score.sample_correct,
                            "completion_tokens": [_policy_tokens(c) for c in mine],
                            "finish_reasons": [c.finish_reason for c in mine],
                            **({"tool_calls": [c.tool_calls for c in mine],
                                "tool_failures": [c.tool_failures for c in mine]} if loop is not None else {}),
                        }, ensure_ascii=False) + "\n")
                if sink is not None:
                    sink.flush()
                seen += len(batch)
                bar.update(len(batch))
                bar.set_postfix(acc=f"{correct / seen:.3f}")
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    finally:
        if started is not None:
            started.close()
    if sink is not None:
        sink.close()
        os.replace(tmp, out_path)
    wall = time.perf_counter() - t0

    names = list(reward_sums)
    counts = np.array([correct, sample_correct, format_ok, completions_total, tokens_total, truncated, tool_calls,
                       tool_failures, turns, *[x for name in names for x in reward_sums[name]]], np.float64)
    if reduce is not None:
        counts = np.asarray(reduce(counts), np.float64)
    (correct, sample_correct, format_ok, completions_total, tokens_total, truncated, tool_calls, tool_failures,
     turns) = (int(round(c)) for c in counts[:9])
    reward_sums = {name: (float(counts[9 + 2 * i]), int(round(counts[10 + 2 * i]))) for i, name in enumerate(names)}
    total = len(questions)
    acc = correct / total
    tool_summary = {} if loop is None else {
        "tools": loop.names, "tool_call_frequency": tool_calls / completions_total,
        "tool_failure_frequency": tool_failures / tool_calls if tool_calls else 0.0,
        "turns_mean": turns / completions_total}
    return {
        "mode": mode, "k": n, "metric": "pass@1" if mode == "greedy" else f"maj@{n}",
        "num_questions": total, "correct": correct, "accuracy": acc,
        "accuracy_stderr": binomial_stderr(acc, total),
        "sample_accuracy": sample_correct / completions_total,
        "format_rate": format_ok / completions_total,
        "mean_completion_tokens": tokens_total / completions_total,
        "truncated_rate": truncated / completions_total,
        "num_completions": completions_total, "skipped_rows": skipped,
        "rewards": {name: total / count if count else math.nan for name, (total, count) in reward_sums.items()},
        "wall_time_s": wall, "load_time_s": load_s, "compile_time_s": compile_s,
        "tokens_per_s": tokens_total / wall if wall > 0 else 0.0,
        "model": str(model_path) if model_path is not None else type(model).__name__,
        "data_path": str(data), "offset": offset,
        "max_new_tokens": max_new_tokens, "temperature": 0.0 if mode == "greedy" else float(temperature),
        "top_p": 1.0 if mode == "greedy" else top_p, "seed": seed, "prompt_style": prompt_style,
        "output": str(out_path) if out_path is not None else None,
        **tool_summary,
    }


def _policy_tokens(completion) -> int:
    """The completion's tokens the model sampled (a tool-using one's tool results left out, as training counts)."""
    return sum(completion.tool_mask) if completion.tool_mask else len(completion.token_ids)


def _tool_loop(tools: Optional["ToolBox"], environment: Optional["Environment"], tokenizer, max_iterations: int,
               use_chat_template: bool):
    """The evaluation's ``ToolLoop`` (None without tools or an environment); the chat template must render them."""
    if tools is None and environment is None:
        return None
    if not use_chat_template:
        raise MindRLHFError("--tools needs the chat template (it shows the model the tools and renders their "
                            "results); drop --no_chat_template")
    from mindrlhf.generation.tool_loop import ToolLoop
    from mindrlhf.rollout_tools import ToolBox, check_template_renders_tools

    loop = ToolLoop(tools if tools is not None else ToolBox([]), tokenizer, max_iterations, environment=environment)
    check_template_renders_tools(tokenizer, loop.schemas)
    return loop


def _add_rewards(sums: Dict[str, list], rewards, texts: List[str], batch: Sequence[Question], n: int,
                 prompt_texts: List[str], done) -> None:
    """Score one batch's completions with ``rewards`` (as training calls them: the prompt as the model saw it,
    the completion ids, the solution and the question as columns) and add each function's scores to ``sums``."""
    rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731  (completions are question-major)
    from mindrlhf.generation.tool_loop import environment_rewards

    _, per_fn = rewards(texts, rep([q.solution for q in batch]), prompts=rep(prompt_texts),
                        completion_ids=[list(c.token_ids) for c in done], question=rep([q.question for q in batch]),
                        **environment_rewards(done))
    for name, scores in per_fn.items():
        given = scores[~np.isnan(scores)]
        sums[name][0] += float(given.sum())
        sums[name][1] += int(given.size)


def _check_output(output: PathLike, inputs: Dict[str, Any], overwrite: bool) -> Path:
    """The results file: never an input or a file inside an input folder (``--overwrite`` included),
    never an existing file unless ``overwrite``, and a place this process can write (checked by writing there)."""
    path = Path(output)
    if path.is_dir():
        raise MindRLHFError(f"--output {path} is a directory; pass a file path such as {path / 'eval.jsonl'}")
    for flag, given in inputs.items():
        if not isinstance(given, (str, os.PathLike)) or not Path(given).exists():
            continue  # not given, not a path (a model object), or missing (reported where it is loaded)
        source = Path(given).resolve()
        where = path.resolve()
        if where == source or source in where.parents:
            what = "is" if where == source else "is inside"
            raise MindRLHFError(f"--output {path} {what} the {flag} input {given}; write the results outside the "
                                f"inputs (--overwrite never replaces an input)")
    if path.exists() and not overwrite:
        raise MindRLHFError(f"--output {path} already exists; pass --overwrite to replace it or choose another file")
    # Written to now, before the model loads: a read-only place must not be found after the whole evaluation.
    probe = path.with_name(path.name + ".tmp")  # where evaluate writes the results as they come
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = probe.exists()
        with open(probe, "a", encoding="utf-8"):
            pass
        if not existed:
            probe.unlink()
    except OSError as err:
        file = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        why = f"{file} is a file, not a folder" if file is not None else err.strerror or str(err)
        raise MindRLHFError(f"--output {path} cannot be written ({why}); choose a writable path") from None
    return path


def format_summary(result: Dict[str, Any]) -> str:
    """The end-of-run summary lines of ``evaluate``'s result."""
    lines = [
        f"GSM8K {result['metric']} on {result['num_questions']} questions "
        f"({result['data_path']}, model {result['model']})",
        f"  accuracy       {result['accuracy']:.4f} ± {result['accuracy_stderr']:.4f} "
        f"({result['correct']}/{result['num_questions']})",
    ]
    if result["mode"] == "maj":
        lines.append(f"  sample acc.    {result['sample_accuracy']:.4f} "
                     f"(mean over {result['num_completions']} completions)")
    lines += [
        f"  format rate    {result['format_rate']:.4f} (completions the "
        f"'{style_format_reward(result['prompt_style'])}' reward scores 1)",
        f"  mean length    {result['mean_completion_tokens']:.1f} tokens "
        f"({result['truncated_rate']:.1%} hit max_new_tokens={result['max_new_tokens']})",
        f"  wall time      {result['wall_time_s']:.1f} s generation+scoring ({result['tokens_per_s']:.1f} tokens/s), "
        f"{result['load_time_s']:.1f} s loading (of the generation time, {result['compile_time_s']:.1f} s was "
        f"graph compilation)",
    ]
    if result.get("tools"):
        lines.append(f"  tools          {', '.join(result['tools'])}: {result['tool_call_frequency']:.2f} calls per "
                     f"completion, {result['tool_failure_frequency']:.1%} of them failed, {result['turns_mean']:.2f} "
                     "assistant turns per completion")
    if result.get("rewards"):
        scores = ", ".join(f"{name} {value:.4f}" for name, value in result["rewards"].items())
        lines.append(f"  rewards        {scores} (mean over {result['num_completions']} completions)")
    if result["skipped_rows"]:
        lines.append(f"  skipped        {result['skipped_rows']} rows without a '#### N' final answer")
    if result["output"]:
        lines.append(f"  per-question results: {result['output']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """Command-line options of ``mindrlhf-eval``."""
    p = argparse.ArgumentParser(prog="mindrlhf-eval",
                                description="Evaluate a model on GSM8K (greedy pass@1 or sampled maj@k) with "
                                            "the training prompt and the training accuracy reward.")
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory, MindSpore .ckpt/.safetensors (config.json next to it), a "
                        "training checkpoint folder (output_dir/checkpoints/step_N) or a LoRA run's PEFT adapter "
                        "folder (output_dir/adapter or a checkpoint of it: evaluated on its base with the adapters "
                        "on); default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--base_model", default=None,
                   help="with an adapter folder as --model: the base model it was trained on (default: the "
                        "base_model_name_or_path its adapter_config.json records)")
    p.add_argument("--tokenizer_dir", default=None, help="tokenizer folder (default: the files next to the model)")
    p.add_argument("--vocab_path", default=None, help="tokenizer vocab.json (with --merges_file_path)")
    p.add_argument("--merges_file_path", default=None, help="tokenizer merges.txt (with --vocab_path)")
    p.add_argument("--data_path", default=None,
                   help="GSM8K question/answer rows: a JSONL file, a .parquet file or a datasets save_to_disk folder; "
                        "verl's GSM8K layout (prompt messages, reward_model.ground_truth, extra_info.question) is "
                        f"read too (default: the packaged {DEFAULT_DATA.name})")
    p.add_argument("--limit", type=int, default=0, help="evaluate the first N questions after --offset (0 = all)")
    p.add_argument("--offset", type=int, default=0, help="skip this many questions first (default 0)")
    p.add_argument("--batch_size", type=int, default=16,
                   help="questions per generate call (default 16); on CPU each compiled prefill shape keeps memory "
                        "that grows with batch x prompt length x cache length, so lower it when memory is short")
    p.add_argument("--max_new_tokens", type=int, default=256, help="completion length limit in tokens (default 256)")
    p.add_argument("--mode", choices=MODES, default="greedy",
                   help="greedy: one argmax completion (pass@1); maj: --k samples, majority vote (maj@k)")
    p.add_argument("--k", type=int, default=8, help="completions per question for --mode maj (default 8)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature for --mode maj (default 0.7)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling for --mode maj (default 1 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed for --mode maj (default 0)")
    p.add_argument("--prompt_style", choices=sorted(PROMPT_STYLES), default=DEFAULT_PROMPT_STYLE,
                   help="the training prompt style: its system prompt, and its format reward for the format "
                        f"rate (gsm8k: a last line '#### N'; tags: <think>/<answer>) (default: {DEFAULT_PROMPT_STYLE})")
    p.add_argument("--system_prompt", default=None,
                   help="system message replacing the --prompt_style one; '' for none")
    p.add_argument("--no_chat_template", action="store_true", help="use the raw question as the prompt")
    p.add_argument("--dtype", default="float32", help="model dtype: float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--output", default=None,
                   help="write per-question results (completions, answers, correctness) to this .jsonl")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument("--device_target", default="CPU", choices=DEVICE_TARGETS, help="MindSpore device (default CPU)")
    p.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    add_vllm_arguments(p)
    add_tool_arguments(p)
    return p


def add_tool_arguments(p: argparse.ArgumentParser) -> None:
    """``--tools`` and its settings, with GRPO's defaults (``configs.grpo_configs.GenerationConfig``)."""
    g = p.add_argument_group("tools", "let the model call tools, as a GRPO run with --tools samples: the chat template "
                                      "shows them in every prompt and their results are appended as tool messages")
    g.add_argument("--tools", nargs="+", default=[], metavar="TOOL",
                   help="built-ins by name (calculator) or user functions as 'package.module:function' (typed, with "
                        "a Google-style docstring; they run in this process)")
    g.add_argument("--max_tool_calling_iterations", type=int, default=5,
                   help="tool rounds per completion at most (default 5); all turns share --max_new_tokens")
    g.add_argument("--tool_timeout", type=float, default=10.0,
                   help="seconds one call may run before it is stopped and answered with an error (default 10; 0 = "
                        "no limit)")
    g.add_argument("--max_tool_response_length", type=int, default=256,
                   help="characters of a tool result kept (default 256; 0 = no limit)")
    g.add_argument("--environment", default="", metavar="PKG.MODULE:CLASS",
                   help="an environment class (one instance per completion, reset with its question and solution; "
                        "its public methods are tools; get_reward() is scored by the 'environment' reward)")


def tool_options(args: argparse.Namespace) -> Optional["ToolBox"]:
    """``evaluate``'s ``tools`` from ``add_tool_arguments``' flags (None without ``--tools`` or ``--environment``,
    whose calls share these limits); a bad tool or limit is named before any model loads."""
    if not args.tools and not args.environment:
        return None
    if args.max_tool_calling_iterations < 0 or args.tool_timeout < 0 or args.max_tool_response_length < 0:
        raise MindRLHFError("--max_tool_calling_iterations, --tool_timeout and --max_tool_response_length must be "
                            ">= 0")
    from mindrlhf.rollout_tools import ToolBox

    return ToolBox(args.tools, timeout=args.tool_timeout, max_response_length=args.max_tool_response_length)


def environment_option(args: argparse.Namespace) -> Optional["Environment"]:
    """``evaluate``'s ``environment`` from ``--environment`` (None without), read before any model loads."""
    if not args.environment:
        return None
    from mindrlhf.rollout_tools.environment import Environment

    return Environment(args.environment)


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """``--use_vllm`` and its settings (``mindrlhf-eval``, ``mindrlhf-data --pairs``)."""
    g = p.add_argument_group("vLLM", "sample with a vLLM engine in its own process (bash scripts/install_vllm.sh "
                                     ".venv-vllm makes its environment); the engine starts in about two minutes")
    g.add_argument("--use_vllm", action="store_true", help="generate with vLLM instead of the native sampler")
    g.add_argument("--vllm_dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the engine's dtype (auto: bfloat16 where the CPU has AVX-512-BF16 or AMX, else float32)")
    g.add_argument("--vllm_python", default="",
                   help="the Python of vLLM's environment (default: $MINDRLHF_VLLM_PYTHON, else .venv-vllm)")
    g.add_argument("--vllm_server", default="",
                   help="the socket of a running `mindrlhf-vllm-serve` engine to use instead of starting one")


def vllm_options(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``evaluate``'s ``vllm`` from ``add_vllm_arguments``' flags (None without ``--use_vllm``); checked before
    any model loads."""
    if not args.use_vllm:
        return None
    from mindrlhf.generation.factory import check_vllm
    from mindrlhf.generation.vllm_sampler import default_vllm_python

    python = args.vllm_python or default_vllm_python()
    check_vllm(python, args.vllm_server, flag="--")
    return {"python": python, "dtype": args.vllm_dtype, "server": args.vllm_server, "seed": args.seed}


def _main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    tools, environment = tool_options(args), environment_option(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import mindspore as ms

    ms.set_device(args.device_target)
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the sampler compiles its steps with mindspore.jit
    result = evaluate(
        args.model, data_path=args.data_path, limit=args.limit, offset=args.offset, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, mode=args.mode, k=args.k, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed, prompt_style=args.prompt_style, system_prompt=args.system_prompt,
        use_chat_template=not args.no_chat_template, dtype=args.dtype, output=args.output, overwrite=args.overwrite,
        progress=not args.no_progress, tokenizer_dir=args.tokenizer_dir, vocab_path=args.vocab_path,
        merges_file_path=args.merges_file_path, base_model=args.base_model, vllm=vllm_options(args),
        tools=tools, max_tool_calling_iterations=args.max_tool_calling_iterations, environment=environment)
    print(format_summary(result))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point (``mindrlhf-eval``): user errors print ``error: ...`` and return 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
