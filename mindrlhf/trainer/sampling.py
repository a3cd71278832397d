"""What a sampling rank reads and draws, colocated (``rollout.RolloutTrainer``) or a generator rank of a
disaggregated job (``disaggregated.GenerationWorker``): its replica's share of the prompts (``load_prompt_dataset``)
and one round's completions (``sample_batches`` with ``sampling_params``, seeded so a resumed run redraws them).

Below both of those modules, so the two sides sample with one definition.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional

from mindrlhf.data import PromptDataset
from mindrlhf.errors import MindRLHFError
from mindrlhf.generation import Completion, Sampler, SamplingParams
from mindrlhf.generation.tool_loop import ToolLoop
from mindrlhf.parallel import comm
from mindrlhf.rollout_tools.environment import environment_rows
from mindrlhf.trainer.base import log_data_report

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    """What one generation round sampled on this generator replica: its prompts (token ids, in dataset
    order) with their reference answers and dataset columns, and G completions per prompt (prompt-major)."""

    prompts: List[List[int]] = field(default_factory=list)
    solutions: List[object] = field(default_factory=list)
    columns: Dict[str, list] = field(default_factory=dict)  # the reward functions' dataset columns, by name
    index: List[int] = field(default_factory=list)
    completions: List[Completion] = field(default_factory=list)
    #: Each completion's policy version (``ScoredRollout.policy_version``) when a generator rank sampled it
    #: (disaggregated rollout); None: this rank's sampler, synced after the last step.
    versions: Optional[List[int]] = None



# -- sampling (a colocated rank's and a generator rank's) -------------------------------------------------
def sampling_params(cfg, step: int, rollout: int, replica: int, num_generations: int,
                    stop_ids: List[int]) -> SamplingParams:
    """The sampling settings of rollout ``rollout`` of step ``step`` on generator replica ``replica``."""
    g = cfg.generation
    # A seed derived from (run seed, step, rollout, rank) makes every step reproducible on its
    # own, which is what lets a resumed run regenerate exactly what the original would have.
    # All tp ranks of a generator replica must draw the same tokens: the seed follows the replica.
    seed = (cfg.train.seed * 1_000_003 + step * 1009 + rollout * 101 + replica) % (2 ** 31)
    return SamplingParams(n=num_generations, temperature=g.temperature, top_p=g.top_p,
                          top_k=g.top_k, min_p=g.min_p, repetition_penalty=g.repetition_penalty,
                          max_tokens=g.max_completion_length, min_tokens=g.min_new_tokens,
                          stop_token_ids=stop_ids, seed=seed, entropy=True)


def sample_batches(sampler: Sampler, dataset: PromptDataset, batches, params_of,
                   tool_loop: Optional[ToolLoop] = None) -> Rollout:
    """G completions for each prompt of ``batches`` (``(r, batch)`` pairs of this replica's share), sampled with
    ``params_of(r)`` (through ``tool_loop``'s turns when the run has tools), with the prompts' answers, columns and
    row ids, in order."""
    out = Rollout()
    for r, batch in batches:
        local = [list(map(int, ids[:n])) for ids, n in zip(batch["prompt_ids"], batch["prompt_length"])]
        params = params_of(r)
        if params.entropy and not sampler.reports_entropy:  # the entropy metric is then left out
            params = replace(params, entropy=False)
        if tool_loop is not None:
            columns = {name: list(batch[key]) for name, key in dataset.reward_columns.items()}
            out.completions += tool_loop.generate(sampler, local, params,
                                                  rows=environment_rows(columns, list(batch["solution"])))
        else:
            out.completions += sampler.generate(local, params)
        out.prompts += local
        out.solutions += list(batch["solution"])
        for name, key in dataset.reward_columns.items():
            out.columns.setdefault(name, []).extend(batch[key])
        out.index += [int(i) for i in batch["index"]]
    return out


# -- the prompts ------------------------------------------------------------------------------------
def prompt_file_format(path: str) -> str:
    """How a prompt file is read: ``"mindrecord"`` (the converter's output: ``PromptDataset``), or the rows format
    ``data.row_files.row_file_format`` names (JSONL, parquet, a datasets save_to_disk folder; read by
    ``text_rows.read_prompt_rows``). A missing file of no rows suffix goes to the mindrecord reader, which names
    the problem."""
    from mindrlhf.data.row_files import row_file_format

    return row_file_format(path) or "mindrecord"


def tool_schemas(cfg) -> Optional[List[Dict[str, object]]]:
    """The JSON schemas of the run's ``tools`` (None without), which every prompt of the default data and every
    conversational prompt row without a ``tools`` column of its own shows (as TRL renders its tools)."""
    g = cfg.generation
    if not g.tools and not g.environment:
        return None
    from mindrlhf.rollout_tools import ToolBox
    from mindrlhf.rollout_tools.environment import Environment

    return ToolBox(g.tools).schemas + (Environment(g.environment).schemas if g.environment else [])


def resolve_dataset(cfg, tokenizer) -> str:
    """The prompt file (``data.mind_dataset_dir``, alias ``train_file``): a mindrecord or prompt rows (JSONL, parquet, a
    datasets save_to_disk folder); the packaged GSM8K sample, tokenised once into output_dir as a mindrecord, by
    default."""
    if cfg.data.mind_dataset_dir:
        return cfg.data.mind_dataset_dir
    from mindrlhf.data.rlhf_data import convert_to_mindrecord
    from mindrlhf.resources import GSM8K_TRAIN_SAMPLE

    tools = tool_schemas(cfg)
    out = Path(cfg.train.output_dir) / "data" / ("gsm8k_train_sample_tools.mindrecord" if tools
                                                 else "gsm8k_train_sample.mindrecord")
    if comm.is_main() and not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        report = convert_to_mindrecord(str(GSM8K_TRAIN_SAMPLE), str(out), tokenizer,
                                       max_prompt_length=cfg.generation.max_prompt_length, show_progress=False,
                                       tools=tools)
        log.info("default data: %s", report.summary())
    comm.job_barrier()  # the other ranks (a disaggregated job's generators too) wait for the file
    return str(out)


def read_prompt_jsonl(path: str, cfg, tokenizer, layout, batch_size: int) -> PromptDataset:
    """A prompt rows file (JSONL, parquet or a save_to_disk folder: ``text_rows.read_prompt_rows``) as a
    ``PromptDataset`` padded to the config's max_prompt_length, like the mindrecord the converter would write. Every
    rank reads it (the same rows); rank 0 logs the summary and names the skipped rows
    (``trainer.base.log_data_report``)."""
    from mindrlhf.data.text_rows import read_prompt_rows

    max_len = cfg.generation.max_prompt_length
    rows, report = read_prompt_rows(path, tokenizer, max_prompt_length=max_len, show_progress=False,
                                    tools=tool_schemas(cfg))
    log_data_report(cfg, report, "train_file")
    if tokenizer.pad_token_id is None:
        raise MindRLHFError(f"the tokenizer from {tokenizer.source} has neither pad_token nor eos_token; "
                            "fix tokenizer_config.json")
    return PromptDataset.from_rows(rows, max_prompt_length=max_len, pad_id=tokenizer.pad_token_id,
                                   batch_size=batch_size, seed=cfg.train.seed, shard_id=layout.data_shard[0],
                                   num_shards=layout.data_shard[1], report=report)


def load_prompt_dataset(cfg, layout, tokenizer, model_config, batch_size: int) -> PromptDataset:
    """This generator replica's share of the prompts (``batch_size`` per global batch), checked against the
    config and the model: prompt length limits, the vocabulary, the context length and the format reward's
    prompt style."""
    data_path = resolve_dataset(cfg, tokenizer)
    if prompt_file_format(data_path) != "mindrecord":
        dataset = read_prompt_jsonl(data_path, cfg, tokenizer, layout, batch_size)
    else:
        # Generator replica j samples its share of every global batch (its tp ranks: the same prompts).
        shard, shards = layout.data_shard
        dataset = PromptDataset(data_path, batch_size=batch_size, seed=cfg.train.seed, shard_id=shard,
                                num_shards=shards)
    if dataset.max_prompt_length > cfg.generation.max_prompt_length:
        raise MindRLHFError(f"{data_path} was built with max_prompt_length={dataset.max_prompt_length} but the config "
                            f"has max_prompt_length={cfg.generation.max_prompt_length}; rebuild the data or raise it")
    check_reward_style(cfg, tokenizer, dataset)
    lengths = dataset.prompt_length.astype(int)
    largest = max((int(ids[:n].max()) for ids, n in zip(dataset.prompt_ids, lengths) if n), default=0)
    if largest >= model_config.vocab_size:
        raise MindRLHFError(f"{data_path} holds token id {largest} but the model's vocabulary has "
                            f"{model_config.vocab_size} tokens: the data was tokenised for another model; rebuild it "
                            f"with rlhf_data.py and this model's tokenizer")
    limit = model_config.max_position_embeddings
    if dataset.max_prompt_length + cfg.generation.max_completion_length > limit:
        raise MindRLHFError(f"max_prompt_length + max_completion_length = "
                            f"{dataset.max_prompt_length + cfg.generation.max_completion_length} exceeds the model's "
                            f"max_position_embeddings={limit}; lower one of them")
    return dataset


def prompt_style_of(tokenizer, dataset) -> Optional[str]:
    """The prompt style the data was built with, read from its first prompt (None: a custom system prompt, or no
    row)."""
    from mindrlhf.data.gsm8k import prompt_style_of_ids

    if not dataset.num_rows:
        return None
    return prompt_style_of_ids(tokenizer, dataset.prompt_ids[0, :int(dataset.prompt_length[0])])


def check_reward_style(cfg, tokenizer, dataset) -> None:
    """A format reward must match the prompt style the data was built with (read from its first
    prompt); the other style's format reward never fires. Custom system prompts are not checked."""
    from mindrlhf.data.gsm8k import check_format_reward

    style = prompt_style_of(tokenizer, dataset)
    if style is not None:
        check_format_reward(style, cfg.reward.reward_funcs, dataset.path)
