"""Training rows for the SFT, reward-model, DPO and RL stages: JSONL files (or parquet files and ``datasets``
save_to_disk folders: ``row_files``, the same rows and rules) tokenised exactly as TRL 1.16 does.

The same file trains the same tokens here and under TRL (``tests/test_text_rows.py`` compares the
ids with TRL's own, recorded by ``tests/make_trl_token_reference.py``). Formats, detected per file
from its first valid row (a row of another format is a bad row):

* SFT (``read_sft_rows``): TRL ``{"prompt", "completion"}`` (two strings, or two lists of
  ``{"role", "content"}`` messages), ReaL ``{"prompt", "answer"}`` (strings; read as TRL's
  prompt/completion), TRL ``{"messages": [...]}`` and ``{"text": str}`` (language modelling: every
  token is trained).
* Pairs (``read_pair_rows``): TRL ``{"prompt", "chosen", "rejected"}`` (strings or message lists),
  TRL's implicit prompt ``{"chosen", "rejected"}`` (whole texts or conversations sharing a prefix,
  split as ``trl.data_utils.extract_prompt`` splits them), ReaL ``{"prompt", "pos_answers",
  "neg_answers"}`` (one pair per index).
* Prompts (``read_prompt_rows``, GRPO and PPO): ReaL's ``{"prompt": str}`` and TRL's prompt-only rows
  (``prompt`` a string or a list of messages); the rows' other keys are the reward functions' columns, and the
  accuracy reward's reference answer is verl's ``reward_model.ground_truth``, else ``solution``, else ``answer``.

Tokenisation, as TRL 1.16's ``SFTTrainer._prepare_dataset`` / ``DPOTrainer._prepare_dataset`` /
``RewardTrainer._prepare_dataset``:

* A plain-text completion gets the tokenizer's ``eos_token`` appended unless it already ends with it
  (text, then tokenised: ``tokenizer(text)``, so a BOS only when the tokenizer adds one). A
  conversational row gets no EOS: the chat template ends the turn (Qwen: ``<|im_end|>\\n``).
* Conversations are rendered with the chat template: the prompt alone with the generation prompt, the
  prompt + completion without it. The row's own ``tools`` (a list or its JSON text) and
  ``chat_template_kwargs`` (an object) columns go to the template, as in TRL.
* The completion starts where the tokenised prompt and the tokenised prompt + completion first differ
  (``trl.data_utils.common_prefix_length``), normally right after the prompt's tokens; when they differ
  earlier (tokens merging across the boundary) TRL starts the completion there and warns once; so do
  we, and the report counts the rows.
* A conversational completion holding non-assistant messages (a tool-using answer: assistant turns with
  ``tool_calls``, ``tool`` messages with the results) trains only its assistant turns, TRL's
  ``assistant_only_loss`` without the template's generation tags: each run of other messages is out of the loss
  from just after the end-of-turn token of the assistant turn before it through the next assistant header (the
  ids ``generation.tool_loop`` appends with ``tool_mask`` 0 at rollout), found by rendering the conversation up to
  and through the run; a template that renders the earlier turns differently once later ones follow skips the row
  (``chat_template_error``). A completion of assistant messages only is read exactly as TRL reads it.
* The first token of a sequence is never trained (nothing predicts it); masks are explicit, never
  derived from token ids, so an EOS that equals the pad id is trained.

Bad rows are skipped with their file, line (a table's 1-based row number) and reason
(``mindrlhf.data.report``); ``strict=True`` makes the first one a one-line ``MindRLHFError``. No MindSpore here.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from jinja2.exceptions import TemplateError
from tqdm import tqdm

from mindrlhf.data.report import REASONS, ConversionReport, SkippedRow, log_report
from mindrlhf.data.row_files import open_rows
from mindrlhf.errors import MindRLHFError

if TYPE_CHECKING:  # annotations only: importing mindrlhf.data stays light
    from mindrlhf.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
_CHUNK = 256  # rows per tokenizer batch (and per progress-bar update)
OVERLONG = ("truncate", "drop")
# The warning TRL 1.16 gives once when the prompt's tokens are not a prefix of the whole's.
BOUNDARY_WARNING = "prompt tokens are not a prefix of the prompt+completion tokens (the completion starts earlier)"

# name -> required keys, per kind; detection takes the first whose keys a row has, so the TRL forms
# with an explicit prompt come before the implicit one.
_SFT_FORMATS: Dict[str, Tuple[str, ...]] = {
    "TRL prompt/completion": ("prompt", "completion"),
    "ReaL prompt/answer": ("prompt", "answer"),
    "TRL messages": ("messages",),
    "TRL text": ("text",),
}
_PAIR_FORMATS: Dict[str, Tuple[str, ...]] = {
    "TRL prompt/chosen/rejected": ("prompt", "chosen", "rejected"),
    "ReaL prompt/pos_answers/neg_answers": ("prompt", "pos_answers", "neg_answers"),
    "TRL implicit-prompt chosen/rejected": ("chosen", "rejected"),
}


@dataclass
class _Rows:
    """What a reader kept, one entry per kept row in each column (the subclass's fields, first the one whose length
    is the row count), with ``source`` (the file) and ``lines`` (each row's 1-based line in it), given by name."""

    source: str = field(kw_only=True)
    lines: List[int] = field(default_factory=list, kw_only=True)

    def __len__(self) -> int:
        return len(getattr(self, next(f.name for f in fields(self) if not f.kw_only)))


@dataclass
class SFTRows(_Rows):
    """``input_ids`` (int32, prompt + completion, at most ``max_length``) and ``completion_mask`` (uint8, 1 on the
    trained tokens, never on the first)."""

    input_ids: List[np.ndarray]
    completion_mask: List[np.ndarray]


@dataclass
class PairRows(_Rows):
    """``prompt_ids`` and the completions ``chosen_ids`` / ``rejected_ids`` (int32; a completion includes its EOS
    or the chat template's end of turn unless truncated); ``prompt_ids + chosen_ids`` is the whole chosen
    sequence. A ReaL row gives one pair per index (each with the row's line)."""

    prompt_ids: List[np.ndarray]
    chosen_ids: List[np.ndarray]
    rejected_ids: List[np.ndarray]

    def columns(self) -> Dict[str, List[np.ndarray]]:
        """The pairs by column, as a pair stage trains on them: ``prompt``, ``chosen`` and ``rejected`` ids."""
        return {"prompt": self.prompt_ids, "chosen": self.chosen_ids, "rejected": self.rejected_ids}


class _Bad(Exception):
    """A bad row: a REASONS key and the detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class _Example:
    """Texts to tokenise for one SFT row or one pair: ``prompt`` alone (None: language modelling)
    and the whole sequence(s), prompt + completion (one for SFT; chosen and rejected for a pair)."""

    line: int
    prompt: Optional[str]
    wholes: List[str]
    label: str = ""  # "pair 2: " when a row holds several pairs
    # An SFT completion's runs of non-assistant messages (tool results): per run, the conversation rendered up to the
    # assistant turn before it (None: the run opens the completion) and through it, with the next assistant header.
    untrained: List[Tuple[Optional[str], str]] = field(default_factory=list)
    untrained_ids: List[Tuple[Optional[List[int]], List[int]]] = field(default_factory=list)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading tokens two id sequences share (TRL's ``common_prefix_length``)."""
    length = 0
    for token, other_token in zip(ids, other):
        if token != other_token:
            break
        length += 1
    return length


def _split_implicit_prompt(chosen: Sequence, rejected: Sequence) -> Tuple[Sequence, Sequence, Sequence]:
    """(prompt, chosen, rejected) as TRL 1.16's ``extract_prompt`` splits them.

    The prompt is the shared leading part (characters or messages); a space just before the first
    difference goes to the completions. When one is a prefix of the other, TRL's loop ends on the
    shorter one's last index, so that element becomes the completion: kept. Where TRL would look at
    ``chosen[-1]`` (a difference at index 0) there is no shared prompt: the row is refused instead.
    """
    size = min(len(chosen), len(rejected))
    idx = size - 1
    for i in range(size):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    if idx <= 0:
        raise _Bad("no_shared_prompt", "the first " + ("message" if isinstance(chosen, list) else "character")
                   + " already differs; add a 'prompt' field")
    return chosen[:idx], chosen[idx:], rejected[idx:]


# The roles of the Hugging Face chat-message format (transformers' chat templating: system, user, assistant, and
# tool for a tool's result). TRL hands messages to the chat template unchecked, and templates treat another role
# in ways a user would not guess: Qwen2.5's drops the message without a word, SmolLM2's (ChatML) renders the
# role's name as given. So a misspelt or invented role ("wizard") would train on another text than the file's:
# such a row is a bad row (unknown_role), in every reader of conversations.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def _check_messages(value: Any, key: str) -> List[Dict[str, Any]]:
    """A non-empty list of messages, each an object with a ``role`` of ``CHAT_ROLES`` and a content."""
    if not isinstance(value, list) or not value:
        raise _Bad("wrong_type", f"'{key}' must be a non-empty list of messages, not {_short(value)}")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Bad("wrong_type", f"'{key}'[{i}] is not a message with a string 'role': {_short(message)}")
        if message["role"] not in CHAT_ROLES:
            raise _Bad("unknown_role", f"'{key}'[{i}] has role {_short(message['role'])}; a chat template knows "
                                       f"{', '.join(CHAT_ROLES)}")
        content = message.get("content")
        if not isinstance(content, (str, list)) and not message.get("tool_calls"):
            raise _Bad("wrong_type", f"'{key}'[{i}] has no string 'content' (nor 'tool_calls')")
    return value


def _texts_or_conversations(row: Dict[str, Any], keys: Sequence[str]) -> bool:
    """Whether ``row[keys]`` are conversations (all message lists) rather than texts (all strings)."""
    values = [row[key] for key in keys]
    if all(isinstance(value, str) for value in values):
        for key in (keys[1:] if keys[0] == "prompt" else keys):  # an empty prompt is allowed, as in TRL
            if not row[key]:
                raise _Bad("empty_completion", f"'{key}' is empty")
        return False
    if all(isinstance(value, list) for value in values):
        for key in keys:
            if key != "prompt" and not row[key]:
                raise _Bad("empty_completion", f"'{key}' is an empty list")
            _check_messages(row[key], key)
        return True
    kinds = ", ".join(f"'{key}' {_type_name(row[key])}" for key in keys)
    raise _Bad("wrong_type", f"{kinds}: they must all be strings or all lists of messages")


class _Reader:
    """One data file (JSONL, parquet or a save_to_disk folder: ``row_files``): format detection, row checks,
    rendering, batched tokenisation."""

    #: The run's tools (JSON schemas) for conversational rows without a ``tools`` column of their own (prompt rows).
    default_tools: Optional[List[Dict[str, Any]]] = None

    def __init__(self, path: PathLike, tokenizer: "Tokenizer", formats: Dict[str, Tuple[str, ...]], kind: str,
                 strict: bool, show_progress: bool,
                 build: Callable[["_Reader", _Example, List[List[int]], Optional[List[int]]], None]) -> None:
        self.source = open_rows(path, kind)
        self.path = self.source.path
        self.tokenizer = tokenizer
        self.formats = formats
        self.kind = kind
        self.strict = strict
        self.show_progress = show_progress
        self.build = build
        self.format: Optional[Tuple[str, bool]] = None  # (format name, conversational)
        self.format_line = 0
        self.report = ConversionReport(str(self.path), None, kept_word="kept")
        self.kept_lines: set = set()
        self.pending: List[_Example] = []
        self.mismatches = 0

    # ------------------------------------------------------------------ bad rows
    def skip(self, line: int, reason: str, detail: str) -> None:
        """Record a bad row (a one-line error under strict)."""
        detail = detail.replace("\n", "\\n")
        if self.strict:
            raise MindRLHFError(f"{self.path}:{line}: {REASONS[reason]}: {detail}; fix the row, or run without "
                                "--strict (or with --strict false) to skip bad rows")
        self.report.skipped.append(SkippedRow(line, reason, detail, str(self.path)))

    # ------------------------------------------------------------------ rows
    def detect(self, row: Dict[str, Any]) -> str:
        """The name of the row's format by its keys, checked against the file's."""
        name = next((name for name, keys in self.formats.items() if all(key in row for key in keys)), None)
        if self.format is not None:
            file_name = self.format[0]
            if name is None:
                missing = [key for key in self.formats[file_name] if key not in row]
                raise _Bad("missing_field", f"no {', '.join(repr(k) for k in missing)} (the file is "
                                            f"{file_name}, set by line {self.format_line})")
            if name != file_name:
                raise _Bad("mixed_format", f"a {name} row in a {file_name} file (set by line {self.format_line})")
        elif name is None:
            choices = "; ".join("+".join(keys) for keys in self.formats.values())
            raise _Bad("missing_field", f"keys {_short(sorted(row))} match no {self.kind} format ({choices})")
        return name

    def settle(self, name: str, conversational: bool, line: int) -> None:
        """Fix the file's format on its first valid row; refuse rows of another one."""
        if self.format is None:
            self.format, self.format_line = (name, conversational), line
            if not conversational and not self.tokenizer.eos_token:
                raise MindRLHFError(f"the tokenizer from {self.tokenizer.source} has no eos_token, which TRL appends "
                                    f"to every plain-text completion of {self.path}; set eos_token in "
                                    "tokenizer_config.json")
        elif self.format[1] != conversational:
            kinds = ("conversational", "plain-text")
            raise _Bad("mixed_format", f"a {kinds[not conversational]} row in a {kinds[conversational]} file "
                                       f"(set by line {self.format_line})")
        if conversational and not self.tokenizer.has_chat_template:
            raise _Bad("no_chat_template", f"the tokenizer from {self.tokenizer.source} has no chat_template; "
                                           "pass the model's tokenizer_config.json")

    def with_eos(self, text: str) -> str:
        """TRL's ``add_eos``: the EOS text appended unless the completion already ends with it."""
        eos = self.tokenizer.eos_token
        return text if text.endswith(eos) else text + eos

    def render(self, row: Dict[str, Any], messages: List[Dict[str, Any]], generation_prompt: bool) -> str:
        """The chat template's text for ``messages``, with the row's tools and template kwargs (as TRL)."""
        tools = row["tools"] if "tools" in row else self.default_tools
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as err:
                raise _Bad("wrong_type", f"'tools' is a string but not JSON ({err})") from None
        if tools is not None and not isinstance(tools, list):
            raise _Bad("wrong_type", f"'tools' must be a list (or its JSON text), not {_type_name(tools)}")
        kwargs = row.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _Bad("wrong_type", f"'chat_template_kwargs' must be an object, not {_type_name(kwargs)}")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                      tools=tools, **kwargs)
        except (TemplateError, TypeError) as err:
            raise _Bad("chat_template_error", f"{type(err).__name__}: {err}") from None

    # ------------------------------------------------------------------ tokenisation
    def flush(self) -> None:
        """Tokenise the pending examples and hand each to the builder."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        special = not self.format[1]  # text as tokenizer(text); rendered chats add no special tokens (transformers)
        prompts = self.tokenizer.encode_batch([ex.prompt for ex in pending if ex.prompt is not None],
                                              add_special_tokens=special)
        wholes = self.tokenizer.encode_batch([text for ex in pending for text in ex.wholes],
                                             add_special_tokens=special)
        marks = self.tokenizer.encode_batch([text for ex in pending for pair in ex.untrained for text in pair
                                             if text is not None], add_special_tokens=special)
        prompt_iter, whole_iter, mark_iter = iter(prompts), iter(wholes), iter(marks)
        for ex in pending:
            prompt_ids = next(prompt_iter) if ex.prompt is not None else None
            whole_ids = [next(whole_iter) for _ in ex.wholes]
            ex.untrained_ids = [(None if before is None else next(mark_iter), next(mark_iter))
                                for before, _ in ex.untrained]
            try:
                self.build(self, ex, whole_ids, prompt_ids)
                self.kept_lines.add(ex.line)
            except _Bad as bad:
                self.skip(ex.line, bad.reason, ex.label + bad.detail)

    def boundary(self, prompt_ids: List[int], whole_ids: Sequence[List[int]]) -> int:
        """Where the completion(s) start: the prompt's tokens shared by every whole (TRL), warned once."""
        start = min(common_prefix_length(prompt_ids, ids) for ids in whole_ids)
        if start < len(prompt_ids):
            if not self.mismatches:
                logger.warning("%s: the tokenised prompt is not a prefix of the tokenised prompt+completion "
                               "(tokens merge across the boundary, or the chat template renders the prompt "
                               "differently); as TRL does, the completion starts where they differ and %r is "
                               "left out of the prompt. Shown once; the report counts the rows.",
                               self.path, self.tokenizer.decode(prompt_ids[start:], skip_special_tokens=False))
            self.mismatches += 1
        return start

    def read(self, parse: Callable[["_Reader", Dict[str, Any], int], List[_Example]]) -> ConversionReport:
        """Read every row of the file (``row_files.RowSource``: JSONL lines or table rows): parse rows into
        examples, tokenise them in chunks, fill the report."""
        done = 0
        with tqdm(total=self.source.total, desc=f"reading {self.path.name}", unit=self.source.unit,
                  unit_scale=self.source.unit == "B", disable=not self.show_progress, file=sys.stderr) as bar:
            for line_no, row, error, advance in self.source.rows():
                done += advance
                self.report.rows_read += 1
                try:
                    if error is not None:
                        raise _Bad("malformed_json", error)
                    if not isinstance(row, dict):
                        raise _Bad("not_an_object", f"a JSON {type(row).__name__}, not an object")
                    self.pending.extend(parse(self, row, line_no))
                except _Bad as bad:
                    if self.strict:
                        self.flush()  # an earlier row may fail at tokenisation: the first bad row is reported
                    self.skip(line_no, bad.reason, bad.detail)
                if len(self.pending) >= _CHUNK:
                    self.flush()
                    bar.update(done)
                    done = 0
            self.flush()
            bar.update(done)
        self.report.skipped.sort(key=lambda row: row.line)
        self.report.rows_written = len(self.kept_lines)
        if self.mismatches:
            self.report.warnings[BOUNDARY_WARNING] = self.mismatches
        return self.report

    def no_rows(self) -> MindRLHFError:
        return self.report.no_usable_rows(self.path, f"check the file's format (the {self.kind} formats: "
                                          f"{', '.join(self.formats)}) and max_length")


# ---------------------------------------------------------------------------------------------- SFT
def _parse_sft(reader: _Reader, row: Dict[str, Any], line: int) -> List[_Example]:
    name = reader.detect(row)
    keys = reader.formats[name]
    if name == "TRL messages":
        messages = _check_messages(row["messages"], "messages")
        reader.settle(name, True, line)
        return [_Example(line, None, [reader.render(row, messages, generation_prompt=False)])]
    if name == "TRL text":
        text = row["text"]
        if not isinstance(text, str):
            raise _Bad("wrong_type", f"'text' must be a string, not {_type_name(text)}")
        if not text:
            raise _Bad("empty_completion", "'text' is empty")
        reader.settle(name, False, line)
        return [_Example(line, None, [reader.with_eos(text)])]
    conversational = _texts_or_conversations(row, keys)
    if name == "ReaL prompt/answer" and conversational:
        raise _Bad("wrong_type", "ReaL's 'prompt' and 'answer' must be strings (conversations: use "
                                 "'prompt'/'completion' message lists)")
    reader.settle(name, conversational, line)
    prompt, completion = row[keys[0]], row[keys[1]]
    if conversational:
        whole = reader.render(row, prompt + completion, generation_prompt=False)
        untrained = []
        for a, b in _non_assistant_runs(completion):
            before = reader.render(row, prompt + completion[:a], generation_prompt=False) if a else None
            through = (reader.render(row, prompt + completion[:b], generation_prompt=True) if b < len(completion)
                       else whole)
            untrained.append((before, through))
        return [_Example(line, reader.render(row, prompt, generation_prompt=True), [whole], untrained=untrained)]
    return [_Example(line, prompt, [prompt + reader.with_eos(completion)])]


def _non_assistant_runs(completion: List[Dict[str, Any]]) -> List[Tuple[int, int]]:
    """``(start, end)`` of each run of consecutive non-assistant messages (tool results) in a completion."""
    runs: List[Tuple[int, int]] = []
    for i, message in enumerate(completion):
        if message["role"] == "assistant":
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _untrained_span(tokenizer: "Tokenizer", ids: List[int], before: Optional[List[int]],
                    through: List[int]) -> Tuple[int, int]:
    """The token range of one run of non-assistant messages in a whole sequence ``ids``: from just after the end-of-turn
    token of the assistant turn before it (the tokens the policy writes end there; what follows is what
    ``rollout_tools.tool_result_ids`` appends at rollout) through the next assistant header."""
    start = 0
    if before is not None:
        stops = set(tokenizer.stop_token_ids)
        ends = [i for i, token in enumerate(before) if token in stops]
        if not ends:
            raise _Bad("chat_template_error", "the assistant turn before a tool message ends with no stop token "
                                              f"(ids {sorted(stops)}); its tool message cannot be kept out of the loss")
        start = ends[-1] + 1
    if (before is not None and ids[:start] != before[:start]) or ids[:len(through)] != through:
        raise _Bad("chat_template_error", "the chat template renders the turns before a tool message differently "
                                          "once later messages follow; its tokens cannot be kept out of the loss")
    return start, len(through)


def read_sft_rows(path: PathLike, tokenizer: "Tokenizer", *, max_length: int, completion_only_loss: bool = True,
                  strict: bool = False, show_progress: bool = True) -> Tuple[SFTRows, ConversionReport]:
    """SFT rows of a JSONL file, tokenised as TRL 1.16's ``SFTTrainer`` with ``max_length``.

    The sequence is cut to its first ``max_length`` tokens (TRL's default ``truncation_mode="keep_start"``)
    and a row left with no trained token is skipped (``nothing_trainable``), as TRL drops it.
    ``completion_only_loss`` (TRL's default for prompt/completion data) trains only the completion, and of a
    conversational completion only its assistant turns (tool results are read, not trained: the module docstring);
    ``False`` trains every token; language-modelling rows (``messages``, ``text``) train every token.
    Raises ``MindRLHFError`` when no row is usable, or, with ``strict``, at the first bad row.
    """
    if max_length < 1:
        raise MindRLHFError(f"max_length {max_length} must be >= 1")
    input_ids: List[np.ndarray] = []
    masks: List[np.ndarray] = []
    lines: List[int] = []

    def build(reader: _Reader, ex: _Example, wholes: List[List[int]], prompt_ids: Optional[List[int]]) -> None:
        ids = wholes[0]
        start = 0 if prompt_ids is None else reader.boundary(prompt_ids, wholes)
        mask = np.ones(len(ids), dtype=np.uint8)
        if completion_only_loss:
            mask[:start] = 0
            for before, through in ex.untrained_ids:  # tool results: read, never trained (assistant-only loss)
                begin, end = _untrained_span(reader.tokenizer, ids, before, through)
                mask[begin:end] = 0
        mask[:1] = 0  # nothing predicts the first token
        if not mask[:max_length].any():
            raise _Bad("nothing_trainable", f"{len(ids)} tokens, the completion from token {start}: "
                                            f"max_length {max_length} leaves no trained token")
        input_ids.append(np.asarray(ids[:max_length], dtype=np.int32))
        masks.append(mask[:max_length])
        lines.append(ex.line)

    reader = _Reader(path, tokenizer, _SFT_FORMATS, "SFT", strict, show_progress, build)
    report = reader.read(_parse_sft)
    if not input_ids:
        raise reader.no_rows()
    return SFTRows(input_ids, masks, source=str(reader.path), lines=lines), report


# ---------------------------------------------------------------------------------------------- pairs
def _parse_pairs(reader: _Reader, row: Dict[str, Any], line: int, max_pairs: int) -> List[_Example]:
    name = reader.detect(row)
    if name.startswith("ReaL"):
        prompt, pos, neg = row["prompt"], row["pos_answers"], row["neg_answers"]
        if not isinstance(prompt, str):
            raise _Bad("wrong_type", f"'prompt' must be a string, not {_type_name(prompt)}")
        for key, answers in (("pos_answers", pos), ("neg_answers", neg)):
            if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
                raise _Bad("wrong_type", f"'{key}' must be a list of strings, not {_short(answers)}")
        if len(pos) != len(neg):
            raise _Bad("unpaired_answers", f"{len(pos)} pos_answers, {len(neg)} neg_answers: "
                                           "give one neg_answer per pos_answer")
        if not pos:
            raise _Bad("no_pairs", "pos_answers and neg_answers are empty")
        for key, answers in (("pos_answers", pos), ("neg_answers", neg)):
            empty = [i for i, a in enumerate(answers) if not a]
            if empty:
                raise _Bad("empty_completion", f"'{key}'[{empty[0]}] is empty")
        reader.settle(name, False, line)
        pairs = list(zip(pos, neg))[:max_pairs or None]
        label = len(pairs) > 1
        return [_Example(line, prompt, [prompt + reader.with_eos(c), prompt + reader.with_eos(r)],
                         f"pair {i}: " if label else "") for i, (c, r) in enumerate(pairs)]
    keys = reader.formats[name]
    conversational = _texts_or_conversations(row, keys)
    if "prompt" in keys:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    else:
        prompt, chosen, rejected = _split_implicit_prompt(row["chosen"], row["rejected"])
    reader.settle(name, conversational, line)
    if conversational:
        return [_Example(line, reader.render(row, prompt, generation_prompt=True),
                         [reader.render(row, prompt + chosen, generation_prompt=False),
                          reader.render(row, prompt + rejected, generation_prompt=False)])]
    return [_Example(line, prompt, [prompt + reader.with_eos(chosen), prompt + reader.with_eos(rejected)])]


def read_pair_rows(path: PathLike, tokenizer: "Tokenizer", *, max_length: int, max_pairs_per_prompt: int = 0,
                   overlong: str = "truncate", strict: bool = False,
                   show_progress: bool = True) -> Tuple[PairRows, ConversionReport]:
    """Preference pairs of a JSONL file for the reward-model and DPO stages, tokenised as TRL 1.16 does.

    ``max_length`` bounds each whole sequence (prompt + chosen, prompt + rejected); TRL's two trainers
    differ, so ``overlong`` picks one:

    * ``"truncate"`` (``DPOTrainer``'s default, ``truncation_mode="keep_start"``): each completion is cut
      so that prompt + completion keeps its first ``max_length`` tokens (the cut may remove the EOS); a
      pair whose prompt alone has ``max_length`` tokens or more is skipped (``nothing_trainable``).
    * ``"drop"`` (``RewardTrainer``): a pair whose prompt + chosen or prompt + rejected is longer than
      ``max_length`` is skipped (``too_long``); nothing is cut.

    ``prompt_ids + chosen_ids`` is TRL's whole sequence either way (``RewardTrainer`` tokenises the whole
    without a split; the split point is DPO's). ``max_pairs_per_prompt`` keeps the first N pairs of a ReaL
    row (0: all). Raises ``MindRLHFError`` when no pair is usable, or, with ``strict``, at the first bad row.
    """
    if max_length < 1:
        raise MindRLHFError(f"max_length {max_length} must be >= 1")
    if max_pairs_per_prompt < 0:
        raise MindRLHFError(f"max_pairs_per_prompt {max_pairs_per_prompt} must be >= 0 (0 keeps every pair)")
    if overlong not in OVERLONG:
        raise MindRLHFError(f"overlong {overlong!r} is unknown; use 'truncate' (DPO) or 'drop' (reward model)")
    prompts: List[np.ndarray] = []
    chosen: List[np.ndarray] = []
    rejected: List[np.ndarray] = []
    lines: List[int] = []

    def build(reader: _Reader, ex: _Example, wholes: List[List[int]], prompt_ids: Optional[List[int]]) -> None:
        start = reader.boundary(prompt_ids, wholes)
        completions = [ids[start:] for ids in wholes]
        if overlong == "truncate":
            if start >= max_length:
                raise _Bad("nothing_trainable", f"the prompt has {start} tokens, max_length {max_length} "
                                                "leaves no completion token")
            completions = [ids[:max_length - start] for ids in completions]
        else:
            longest = max(len(ids) for ids in wholes)
            if longest > max_length:
                raise _Bad("too_long", f"{longest} tokens > max_length {max_length}")
        # A pair whose two sides are the same tokens states no preference: its preference loss has no gradient
        # in exact arithmetic (DPO's ln 2, the RM's margin 0), yet float noise (~1e-8), which Adam normalises,
        # still moves the weights. TRL keeps such pairs; we skip and count them. Compared as tokens after the cut,
        # which is what the loss sees: equal texts give equal tokens, and two answers that differ only past
        # max_length train as one.
        if completions[0] == completions[1]:
            cut = " after the cut to max_length" if max(len(ids) for ids in wholes) > max_length else ""
            raise _Bad("identical_pair", f"chosen and rejected are the same {len(completions[0])} tokens{cut}")
        if start == 0 and min(len(ids) for ids in completions) < 2:  # with no prompt the first token is untrained
            raise _Bad("nothing_trainable", "no prompt token and a one-token completion: nothing is trained")
        prompts.append(np.asarray(prompt_ids[:start], dtype=np.int32))
        chosen.append(np.asarray(completions[0], dtype=np.int32))
        rejected.append(np.asarray(completions[1], dtype=np.int32))
        lines.append(ex.line)

    reader = _Reader(path, tokenizer, _PAIR_FORMATS, "pair", strict, show_progress, build)
    report = reader.read(lambda r, row, line: _parse_pairs(r, row, line, max_pairs_per_prompt))
    if not prompts:
        raise reader.no_rows()
    report.examples = f"{len(prompts)} pairs"
    return PairRows(prompts, chosen, rejected, source=str(reader.path), lines=lines), report



def read_pairs(cfg, path: PathLike, tokenizer: "Tokenizer", what: str, overlong: str, *,
               main: bool = True) -> Tuple[PairRows, ConversionReport]:
    """A pair stage's read of its ``what`` file (``train_file``): ``read_pair_rows`` as the config's ``data``
    group says (``cfg.data.max_length``, ``max_pairs_per_prompt``, ``strict``), its report logged once, on the
    ``main`` rank, with its skipped rows named (``report.log_report``; the listing is in ``cfg.train.output_dir``).
    ``overlong``: ``"drop"`` (the reward model, TRL's RewardTrainer) or ``"truncate"`` (DPO)."""
    pairs, report = read_pair_rows(path, tokenizer, max_length=cfg.data.max_length,
                                   max_pairs_per_prompt=cfg.data.max_pairs_per_prompt, overlong=overlong,
                                   strict=cfg.data.strict, show_progress=main)
    if main:
        log_report(report, what, cfg.train.output_dir)
    return pairs, report

def require_pair_file(cfg) -> None:
    """A pair stage's first check, before any model is looked at: it has a ``train_file``."""
    if not cfg.data.train_file:
        raise MindRLHFError("--train_file is required: preference pairs as jsonl (README: preference data; "
                            "mindrlhf-data --pairs builds GSM8K pairs)")


def read_pair_files(cfg, tokenizer: "Tokenizer", overlong: str, *, main: bool = True
                    ) -> Tuple[PairRows, Optional[PairRows], List[ConversionReport]]:
    """A pair stage's ``train_file`` and optional ``valid_file`` through ``read_pairs``: the train pairs, the
    validation pairs (None without a file) and the reports of what was read."""
    require_pair_file(cfg)
    train, train_report = read_pairs(cfg, cfg.data.train_file, tokenizer, "train_file", overlong, main=main)
    if not cfg.data.valid_file:
        return train, None, [train_report]
    valid, valid_report = read_pairs(cfg, cfg.data.valid_file, tokenizer, "valid_file", overlong, main=main)
    return train, valid, [train_report, valid_report]

# ---------------------------------------------------------------------------------------------- prompts
#: Keys of a prompt row that reward functions do not get as dataset columns, as in TRL's GRPOTrainer (the
#: prompt reaches them as ``prompts``; a completion's text and ids are the sampled ones).
PROMPT_ROW_NOT_COLUMNS = ("prompt", "completion", "completion_ids")
#: Arguments every reward function already gets: a column of one of these names cannot be passed too.
_REWARD_ARGUMENTS = ("prompts", "completions")
_PROMPT_FORMATS: Dict[str, Tuple[str, ...]] = {"TRL/ReaL prompt": ("prompt",)}
#: The report's warning for rows without a reference answer (the built-in accuracy reward scores them None).
NO_SOLUTION_WARNING = ("no reward_model.ground_truth, 'solution' or 'answer' column: the accuracy reward gives them "
                       "no score")


@dataclass
class PromptRows(_Rows):
    """One entry per kept prompt row: ``prompt_ids`` (int32, the prompt as the policy sees it), ``solutions``
    (the reference answer the built-in ``accuracy`` reward reads: the row's ``solution``, else the final answer of
    its ``answer``, else None), ``columns`` (the reward functions' other dataset columns: every key of the file's
    rows but the prompt, one value per kept row, None where a row lacks the key; ``question`` is always one) and
    ``lines`` (1-based, in ``source``)."""

    prompt_ids: List[np.ndarray]
    solutions: List[Any]
    columns: Dict[str, List[Any]]


class _PromptReader(_Reader):
    """A ``_Reader`` for prompt rows: nothing is appended to a prompt, so no EOS is needed."""

    def settle(self, name: str, conversational: bool, line: int) -> None:
        if self.format is None and not conversational:
            self.format, self.format_line = (name, False), line
            return
        super().settle(name, conversational, line)


def _row_solution(row: Dict[str, Any]) -> Any:
    """The reference answer of a prompt row: verl's ``reward_model.ground_truth`` (its data layout, e.g. the GSM8K
    preprocessing's parquet) as given, else its ``solution`` as given (TRL passes columns unchanged), else the
    final answer of its ``answer`` as the prompt mindrecord holds it (``rlhf_data``: the number after GSM8K's
    ``####``, or the answer itself when it has no marker), else None."""
    from mindrlhf.data.gsm8k import final_answer

    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return reward_model["ground_truth"]
    if "solution" in row:
        return row["solution"]
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return None  # no answer, or a structured one: only the user's own rewards can read it
    solution, why = final_answer(answer, "gsm8k" if isinstance(answer, str) and "####" in answer else "generic")
    if solution is None:
        raise _Bad("no_final_answer", f"'answer': {why}")
    return solution


def _parse_prompt(reader: _Reader, row: Dict[str, Any], line: int) -> Tuple[List[_Example], Dict[str, Any]]:
    """The example of one prompt row (its prompt text, tokenised as it is) and its reward columns."""
    name = reader.detect(row)
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _Bad("missing_field", "'prompt' is empty")
        conversational = False
    elif isinstance(prompt, list):
        _check_messages(prompt, "prompt")  # the message rules of every conversational row
        conversational = True
    else:
        raise _Bad("wrong_type", f"'prompt' must be a string or a list of messages, not {_type_name(prompt)}")
    clash = [key for key in _REWARD_ARGUMENTS if key in row]
    if clash:
        raise _Bad("wrong_type", f"column '{clash[0]}' is an argument every reward function already gets; rename it")
    solution = _row_solution(row)
    reader.settle(name, conversational, line)
    columns = {key: value for key, value in row.items() if key not in PROMPT_ROW_NOT_COLUMNS and key != "solution"}
    if "question" not in columns:  # the mindrecord's column: the question the prompt asks
        users = [m.get("content") for m in prompt if m.get("role") == "user"] if conversational else [prompt]
        columns["question"] = users[-1] if users else None
    # TRL 1.x GRPOTrainer._tokenize_prompts: a text prompt is tokenised as it is (tokenizer(text), so a BOS only
    # when the tokenizer adds one); a conversational one goes through the chat template with
    # add_generation_prompt=True (tokenised without special tokens: the template writes them).
    text = reader.render(row, prompt, generation_prompt=True) if conversational else prompt
    return [_Example(line, None, [text])], {"solution": solution, "columns": columns}


def read_prompt_rows(path: PathLike, tokenizer: "Tokenizer", *, max_prompt_length: int, strict: bool = False,
                     show_progress: bool = True,
                     tools: Optional[Sequence[Dict[str, Any]]] = None) -> Tuple[PromptRows, ConversionReport]:
    """The prompts of a JSONL file for the RL stages (GRPO, PPO): ReaL's ``{"prompt": text}`` rows and TRL's
    prompt-only rows (``prompt`` a text or a list of ``{"role", "content"}`` messages), tokenised as TRL's
    ``GRPOTrainer`` does. A prompt longer than ``max_prompt_length`` tokens is skipped, never truncated (as the
    prompt mindrecord converter does). The rows' other keys are the reward functions' dataset columns
    (``PromptRows``). ``tools``: the run's tools' JSON schemas, rendered into every conversational prompt that has no
    ``tools`` column of its own (as TRL's ``GRPOTrainer(tools=...)`` renders its tools into every prompt). Raises
    ``MindRLHFError`` when no row is usable, or, with ``strict``, at the first bad row.
    """
    if max_prompt_length < 1:
        raise MindRLHFError(f"max_prompt_length {max_prompt_length} must be >= 1")
    pending: Dict[int, Dict[str, Any]] = {}  # line -> its solution and columns, until the row is tokenised
    prompt_ids: List[np.ndarray] = []
    kept: List[Dict[str, Any]] = []
    lines: List[int] = []

    def parse(reader: _Reader, row: Dict[str, Any], line: int) -> List[_Example]:
        examples, pending[line] = _parse_prompt(reader, row, line)
        return examples

    def build(reader: _Reader, ex: _Example, wholes: List[List[int]], prompt: Optional[List[int]]) -> None:
        ids, extra = wholes[0], pending.pop(ex.line)
        if len(ids) > max_prompt_length:
            raise _Bad("prompt_too_long", f"{len(ids)} tokens > max_prompt_length {max_prompt_length}")
        prompt_ids.append(np.asarray(ids, dtype=np.int32))
        kept.append(extra)
        lines.append(ex.line)

    reader = _PromptReader(path, tokenizer, _PROMPT_FORMATS, "prompt", strict, show_progress, build)
    reader.default_tools = list(tools) if tools else None
    report = reader.read(parse)
    if not prompt_ids:
        raise report.no_usable_rows(reader.path, "each row needs a 'prompt' (a text or a list of messages) of at "
                                    "most max_prompt_length tokens")
    names: List[str] = []
    for extra in kept:  # every key of any row, in the order they first appear
        names += [key for key in extra["columns"] if key not in names]
    columns = {name: [extra["columns"].get(name) for extra in kept] for name in names}
    solutions = [extra["solution"] for extra in kept]
    missing = sum(solution is None for solution in solutions)
    if missing:
        report.warnings[NO_SOLUTION_WARNING] = missing
    return PromptRows(prompt_ids, solutions, columns, source=str(reader.path), lines=lines), report
