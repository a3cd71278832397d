"""Byte-level BPE tokenizer (Qwen2 / GPT-2 style) and Jinja chat templates, without transformers.

The `tokenizers` pipeline is rebuilt the way Hugging Face's fast tokenizers build it, so ids match
``transformers.AutoTokenizer`` exactly:

* ``Qwen2Tokenizer``: NFC normalizer, Qwen's split regex (digits one by one, letters with one
  leading non-letter, ...), byte-level BPE without a prefix space.
* ``GPT2Tokenizer`` (GPT-2, and the vocab.json/merges.txt files of Llama-architecture SmolLM2):
  no normalizer, the GPT-2 regex inside the ByteLevel pre-tokenizer.

Any other ``tokenizer_class`` falls back to the Qwen2 pipeline (the family this toolkit targets),
with a logged warning; so does a missing one (no config), silently. A ``tokenizer.json`` is used
verbatim when ``from_dir`` finds one: it is the complete pipeline description, so no guessing from
the class name is needed (SmolLM2's, for example, also splits digits one by one, which its
vocab.json/merges.txt pair cannot express).

Added/special tokens come from ``tokenizer_config.json`` (``added_tokens_decoder``),
``added_tokens.json`` and ``special_tokens_map.json``; they keep the ids those files give.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from mindrlhf.errors import MindRLHFError

logger = logging.getLogger(__name__)

QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_CLASSES = {"Qwen2Tokenizer", "Qwen2TokenizerFast"}
_GPT2_CLASSES = {"GPT2Tokenizer", "GPT2TokenizerFast"}
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' class defaults, used only when tokenizer_config.json does not mention the key at all
# (an explicit null means "no such token").
_CLASS_DEFAULTS = {
    "qwen2": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
    "gpt2": {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
}
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")

Message = Dict[str, Any]


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as err:
        raise MindRLHFError(f"{path} is not valid JSON ({err}); restore the file from the model repository") from None
    if not isinstance(data, dict):
        raise MindRLHFError(f"{path} must hold a JSON object; restore the file from the model repository")
    return data


def _token_content(value: Any) -> Optional[str]:
    """A special-token entry is a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_added_token(value: Any, special: bool) -> AddedToken:
    if isinstance(value, dict):
        return AddedToken(
            value["content"],
            single_word=value.get("single_word", False),
            lstrip=value.get("lstrip", False),
            rstrip=value.get("rstrip", False),
            normalized=value.get("normalized", not special),
            special=value.get("special", special),
        )
    return AddedToken(value, special=special, normalized=not special)


def _pipeline_kind(tokenizer_class: Optional[str]) -> str:
    if tokenizer_class in _GPT2_CLASSES:
        return "gpt2"
    if tokenizer_class is not None and tokenizer_class not in _QWEN2_CLASSES:
        logger.warning("tokenizer_class %r is not Qwen2Tokenizer or GPT2Tokenizer; using the Qwen2 pre-tokenizer",
                       tokenizer_class)
    return "qwen2"


def _check_file(path: Union[str, os.PathLike], what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise MindRLHFError(f"{what} not found: {path}; pass the path of the model's {what}")
    return path


#: Files that make up a tokenizer folder (whichever of them exist are copied along with a model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "chat_template.jinja")


class Tokenizer:
    """A Hugging Face-compatible byte-level BPE tokenizer with its chat template.

    Build it with :meth:`from_dir` or :meth:`from_files`; ``Tokenizer(backend, config)`` takes an
    already configured ``tokenizers.Tokenizer`` and the merged tokenizer config.
    """

    def __init__(self, backend: _Backend, config: Dict[str, Any], source: str = "<memory>") -> None:
        self.backend = backend
        self.config = config
        self.source = source
        self._template_cache: Dict[str, Any] = {}
        self._tool_forms: Dict[str, Optional[str]] = {}  # per template name: the Hermes ChatML form, or None
        self.special_tokens: Dict[str, str] = {}
        for name in _NAMED_SPECIAL:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens[name] = content

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_files(
        cls,
        vocab_path: Union[str, os.PathLike],
        merges_path: Union[str, os.PathLike],
        tokenizer_config_path: Optional[Union[str, os.PathLike]] = None,
    ) -> "Tokenizer":
        """Build from ``vocab.json`` + ``merges.txt``.

        With ``tokenizer_config_path``, that config (chat template, special tokens, class) is used,
        and ``added_tokens.json`` / ``special_tokens_map.json`` next to it are read when present.
        """
        vocab_path = _check_file(vocab_path, "vocab.json")
        merges_path = _check_file(merges_path, "merges.txt")
        config: Dict[str, Any] = {}
        added: Dict[str, int] = {}
        if tokenizer_config_path is not None:
            config_path = _check_file(tokenizer_config_path, "tokenizer_config.json")
            config = _read_json(config_path)
            config, added = cls._merge_side_files(config, config_path.parent)
        backend = cls._build_bpe(vocab_path, merges_path, config, added)
        return cls(backend, config, source=str(vocab_path.parent))

    @classmethod
    def from_dir(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """Build from a Hugging Face tokenizer folder (``tokenizer.json`` or ``vocab.json`` + ``merges.txt``)."""
        folder = Path(path)
        if not folder.is_dir():
            raise MindRLHFError(f"tokenizer directory not found: {folder}; pass the folder holding vocab.json")
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        config, added = cls._merge_side_files(config, folder)
        if (folder / "tokenizer.json").is_file():
            backend = _Backend.from_file(str(folder / "tokenizer.json"))
            # The file defines the whole pipeline; only config-named special tokens it lacks are added
            # (no class defaults: they describe the vocab.json + merges.txt construction).
            cls._add_special_tokens(backend, config, added, kind=None)
            return cls(backend, config, source=str(folder))
        if not (folder / "vocab.json").is_file() or not (folder / "merges.txt").is_file():
            raise MindRLHFError(
                f"{folder} has neither tokenizer.json nor vocab.json + merges.txt; "
                "point to a Hugging Face tokenizer folder"
            )
        backend = cls._build_bpe(folder / "vocab.json", folder / "merges.txt", config, added)
        return cls(backend, config, source=str(folder))

    @staticmethod
    def _merge_side_files(config: Dict[str, Any], folder: Path) -> tuple:
        """Fold special_tokens_map.json and chat_template.jinja into ``config``; return (config, added_tokens)."""
        config = dict(config)
        map_path = folder / "special_tokens_map.json"
        if map_path.is_file():
            for key, value in _read_json(map_path).items():
                config.setdefault(key, value)
        jinja_path = folder / "chat_template.jinja"
        if "chat_template" not in config and jinja_path.is_file():
            config["chat_template"] = jinja_path.read_text(encoding="utf-8")
        added_path = folder / "added_tokens.json"
        added = _read_json(added_path) if added_path.is_file() else {}
        return config, added

    @classmethod
    def _build_bpe(cls, vocab_path: Path, merges_path: Path, config: Dict[str, Any], added: Dict[str, int]) -> _Backend:
        kind = _pipeline_kind(config.get("tokenizer_class"))
        try:
            vocab, merges = BPE.read_file(str(vocab_path), str(merges_path))
        except Exception as err:  # the Rust reader reports bad files as a generic Exception
            raise MindRLHFError(f"cannot read {vocab_path} / {merges_path} ({err}); "
                                "use the model's original files") from None
        # Give added tokens their declared ids up front: tokenizers would otherwise number new tokens
        # sequentially after the vocab, which is only right when the ids happen to be contiguous.
        declared = dict(added)
        for token_id, entry in config.get("added_tokens_decoder", {}).items():
            declared[entry["content"]] = int(token_id)
        for content, token_id in declared.items():
            vocab.setdefault(content, token_id)
        backend = _Backend(BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
        add_prefix_space = bool(config.get("add_prefix_space", False))
        if kind == "qwen2":
            backend.normalizer = normalizers.NFC()
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ])
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        cls._add_special_tokens(backend, config, added, kind)
        cls._set_post_processor(backend, config)
        return backend

    @staticmethod
    def _add_special_tokens(backend: _Backend, config: Dict[str, Any], added: Dict[str, int],
                            kind: Optional[str]) -> None:
        """Register added tokens in transformers' order: added_tokens_decoder, added_tokens.json, named specials."""
        for _, entry in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0])):
            token = _as_added_token(entry, special=entry.get("special", False))
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
        known = {token.content for token in backend.get_added_tokens_decoder().values()}
        for content, _ in sorted(added.items(), key=lambda item: item[1]):
            if content not in known:
                backend.add_tokens([AddedToken(content, special=False, normalized=True)])
                known.add(content)
        specials: List[Any] = []
        for name in _NAMED_SPECIAL:
            value = config.get(name, _CLASS_DEFAULTS.get(kind, {}).get(name))
            if name not in config and value is not None:
                config[name] = value  # record the class default so the named-token properties see it
            if value is not None:
                specials.append(value)
        for key in ("additional_special_tokens", "extra_special_tokens"):
            if isinstance(config.get(key), list):
                specials.extend(config[key])
        for value in specials:
            content = _token_content(value)
            if content is not None and content not in known:
                backend.add_special_tokens([_as_added_token(value, special=True)])
                known.add(content)

    @staticmethod
    def _set_post_processor(backend: _Backend, config: Dict[str, Any]) -> None:
        """``add_bos_token`` / ``add_eos_token`` wrap the ids when ``add_special_tokens=True``
        (transformers does the same)."""
        bos = _token_content(config.get("bos_token")) if config.get("add_bos_token") else None
        eos = _token_content(config.get("eos_token")) if config.get("add_eos_token") else None
        if bos is None and eos is None:
            return
        pieces = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
        pair = pieces + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
        special = [(tok, backend.token_to_id(tok)) for tok in dict.fromkeys(t for t in (bos, eos) if t)]
        backend.post_processor = processors.TemplateProcessing(single=" ".join(pieces), pair=" ".join(pair),
                                                               special_tokens=special)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay single tokens."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> List[List[int]]:
        """:meth:`encode` for many texts (the Rust side runs them in parallel)."""
        return [enc.ids for enc in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences become U+FFFD (HF's ``errors="replace"``)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> List[str]:
        """:meth:`decode` for many sequences."""
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a token string (vocab or added), or None."""
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ special tokens
    def _named_id(self, name: str) -> Optional[int]:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    @property
    def eos_token(self) -> Optional[str]:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> Optional[str]:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._named_id("eos_token")

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._named_id("bos_token")

    @property
    def pad_token_id(self) -> Optional[int]:
        """The pad id, or the eos id when the tokenizer defines no pad token (common for chat models)."""
        pad = self._named_id("pad_token")
        return self.eos_token_id if pad is None else pad

    @property
    def stop_token_ids(self) -> List[int]:
        """Ids that end a generation: eos, plus ``<|im_end|>`` and ``<|endoftext|>`` when the vocab has them."""
        ids = [self.eos_token_id] + [self.backend.token_to_id(tok) for tok in _STOP_TOKENS]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (``len(hf_tokenizer)``; the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # ------------------------------------------------------------------ chat template
    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer config carries a chat template."""
        return bool(self.config.get("chat_template"))

    def _chat_template(self, name: Optional[str]) -> str:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {item["name"]: item["template"] for item in template}
        if isinstance(template, dict):
            template = template.get(name or "default")
        if not template:
            raise MindRLHFError(
                f"tokenizer_config.json in {self.source} has no chat_template; pass the model's tokenizer_config.json "
                "(it holds the template) or build prompts without a chat template"
            )
        return template

    def _compiled(self, template: str) -> Any:
        if template not in self._template_cache:
            from jinja2.exceptions import TemplateError
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            def tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
                       separators: Any = None, sort_keys: bool = False) -> str:
                # Jinja's own tojson HTML-escapes; chat templates expect plain JSON (as in transformers).
                return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            # Same environment options as transformers, so whitespace control renders identically.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template_cache[template] = env.from_string(template)
        return self._template_cache[template]

    def _tool_form(self, name: Optional[str]) -> Optional[str]:
        """The Hermes ChatML template when this tokenizer's template is ChatML (it writes ``<|im_start|>`` turns, and
        both turn tokens are in the vocabulary) and renders no tools; None otherwise (its own template is used, and
        a check that tools are shown refuses it)."""
        key = name or "default"
        if key not in self._tool_forms:
            form = None
            source = self._chat_template(name)
            if ("<|im_start|>" in source and self.token_to_id("<|im_start|>") is not None
                    and self.token_to_id("<|im_end|>") is not None):
                own = self._compiled(source)
                probe = [{"role": "user", "content": "2 + 2?"}]
                schema = [{"type": "function", "function": {"name": "probe_tool_name", "parameters": {}}}]
                variables = {**self.special_tokens, "documents": None}
                shown = own.render(messages=probe, add_generation_prompt=True, tools=schema, **variables)
                if "probe_tool_name" not in shown:
                    from mindrlhf.resources import HERMES_CHATML_TOOLS

                    form = HERMES_CHATML_TOOLS.read_text(encoding="utf-8")
                    logger.info("the chat template of %s renders no tools: conversations with tools use the Hermes "
                                "ChatML form (docs/how-to/tools.md)", self.source)
            self._tool_forms[key] = form
        return self._tool_forms[key]

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> Union[str, List[int]]:
        """Render ``messages`` with the tokenizer's Jinja chat template (as transformers does).

        A conversation with tools (``tools=`` schemas, assistant ``tool_calls`` or ``tool`` messages) on a ChatML
        tokenizer whose template renders no tools uses the Hermes form instead (``resources/
        hermes_chatml_tools.jinja``: the schemas in the system turn, ``<tool_call>`` and ``<tool_response>``
        blocks, as Qwen2.5 writes them), so such a model can be taught and trained to call tools.

        Extra ``kwargs`` (``tools``, ``documents``, ``chat_template_name``, anything the template reads)
        are passed to the template. Returns the prompt string, or its ids when ``tokenize=True``.
        """
        name = kwargs.pop("chat_template_name", None)
        form = self._tool_form(name) if _has_tools(messages, kwargs.get("tools")) else None
        template = self._compiled(form if form is not None else self._chat_template(name))
        # transformers drops None-valued keys: templates test for a key's presence, not for None.
        chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        text = template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text) if tokenize else text


def _has_tools(messages: Sequence[Message], tools: Any) -> bool:
    """Whether a conversation involves tools: schemas given, or a tool call or result among its messages."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def resolve_tokenizer(model_path: Optional[Union[str, os.PathLike]] = None,
                      tokenizer_dir: Optional[Union[str, os.PathLike]] = None,
                      vocab_path: Optional[Union[str, os.PathLike]] = None,
                      merges_file_path: Optional[Union[str, os.PathLike]] = None,
                      tokenizer_config: Optional[Union[str, os.PathLike]] = None) -> "Tokenizer":
    """The tokenizer the user asked for, the one way every command resolves it.

    From ``tokenizer_dir``; else ``vocab_path`` + ``merges_file_path`` (with ``tokenizer_config``,
    default the tokenizer_config.json beside the vocab when present); else the files next to
    ``model_path`` (an HF dir or a checkpoint file).
    """
    if tokenizer_dir and (vocab_path or merges_file_path):
        raise MindRLHFError("pass either --tokenizer_dir or --vocab_path/--merges_file_path, not both")
    if tokenizer_dir:
        return Tokenizer.from_dir(tokenizer_dir)
    if vocab_path or merges_file_path:
        if not (vocab_path and merges_file_path):
            raise MindRLHFError("--vocab_path and --merges_file_path go together; pass both (or --tokenizer_dir)")
        if tokenizer_config is None:
            beside = Path(vocab_path).parent / "tokenizer_config.json"
            tokenizer_config = str(beside) if beside.is_file() else None
        return Tokenizer.from_files(vocab_path, merges_file_path, tokenizer_config)
    if model_path is None:
        raise MindRLHFError("no tokenizer given; pass --tokenizer_dir or --vocab_path/--merges_file_path")
    if not Path(model_path).exists():
        raise MindRLHFError(f"model path {model_path} does not exist; check the path (an HF folder or a .ckpt / "
                            f".safetensors file) or convert the model first with convert_weight.py")
    folder = Path(model_path) if Path(model_path).is_dir() else Path(model_path).parent
    if not ((folder / "tokenizer.json").is_file() or (folder / "vocab.json").is_file()):
        raise MindRLHFError(f"no tokenizer files next to the model in {folder}; pass --tokenizer_dir or "
                            f"--vocab_path/--merges_file_path")
    return Tokenizer.from_dir(folder)
