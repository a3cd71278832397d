"""Generic machinery for grouped dataclass configs.

A *grouped config* is a dataclass whose attributes are *group* dataclasses (``cfg.algorithm``,
``cfg.optimizer``, ...). Every group field carries ``metadata={"help": ...}`` and optional
declarative checks (``choices``, ``ge``/``gt``/``le``/``lt`` bounds, value ``aliases``) and other
names for its key (``key_aliases``: another project's spelling of the same setting). Field names
and key aliases are unique across all groups, so a field can be written flat (``beta: 0.04``,
``--beta 0.04``) or grouped (``algorithm: {beta: 0.04}``).

This module knows nothing about GRPO: it provides typed coercion, YAML and command-line loading,
YAML saving and the Markdown reference. ``mindrlhf.configs.grpo_configs`` defines the fields and
the cross-field rules.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import yaml

from mindrlhf.errors import MindRLHFError
from mindrlhf.utils.fs import write_text_atomic

_MISSING = dataclasses.MISSING
log = logging.getLogger(__name__)
#: Moved fields already warned about in this process (one warning each, however often a config is read).
_WARNED_MOVED: set = set()


def config_field(
    default: Any,
    help: str,  # noqa: A002 - mirrors dataclasses/argparse naming
    *,
    choices: Optional[Sequence[Any]] = None,
    aliases: Optional[Dict[str, str]] = None,
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    le: Optional[float] = None,
    lt: Optional[float] = None,
    cli_const: Optional[str] = None,
    key_aliases: Sequence[str] = (),
) -> Any:
    """A dataclass field with ``metadata={"help": help, ...}``.

    ``choices``: allowed values; ``aliases``: accepted spellings mapped to a canonical value
    (``{"bf16": "bfloat16"}``); ``ge/gt/le/lt``: bounds checked by ``validate`` (for lists, on every
    element); ``cli_const``: the value of a bare ``--flag`` given without a value; ``key_aliases``:
    other names of this field in YAML and on the command line (``start_lr`` for ``lr``), documented
    in the reference; giving a name and its alias with different values is an error.
    Mutable defaults (lists) are copied per instance.
    """
    metadata: Dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if aliases:
        metadata["aliases"] = dict(aliases)
    for key, bound in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)):
        if bound is not None:
            metadata[key] = bound
    if cli_const is not None:
        metadata["cli_const"] = cli_const
    if key_aliases:
        metadata["key_aliases"] = tuple(key_aliases)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda d=tuple(default): list(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# ----------------------------------------------------------------------------------------------
# Types
# ----------------------------------------------------------------------------------------------
def _optional_inner(tp: Any) -> Optional[Any]:
    """``X`` for ``Optional[X]`` / ``X | None``; ``None`` for any other type."""
    if typing.get_origin(tp) in (typing.Union, getattr(types, "UnionType", typing.Union)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _list_item(tp: Any) -> Optional[Any]:
    """``X`` for ``list[X]``; ``None`` for any other type."""
    if typing.get_origin(tp) in (list, List):
        (item,) = typing.get_args(tp) or (Any,)
        return item
    return None


def _bool_or_str(tp: Any) -> bool:
    """``bool | str`` (``Union[bool, str]``): a switch that may instead carry a path."""
    return (typing.get_origin(tp) in (typing.Union, getattr(types, "UnionType", typing.Union))
            and set(typing.get_args(tp)) == {bool, str})


#: How booleans may be written (YAML, command line): MindRLHF's scripts pass 1/0 and True/False.
BOOL_SPELLINGS = {"true": True, "false": False, "1": True, "0": False}


def _as_bool(value: Any) -> Optional[bool]:
    """``value`` as a bool if it is one of the accepted spellings (any case), else None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # YAML reads `use_vllm: 1` as an int
        return bool(value)
    if isinstance(value, str):
        return BOOL_SPELLINGS.get(value.strip().lower())
    return None


def type_name(tp: Any) -> str:
    """Human-readable type: ``int``, ``list[str]``, ``list[float] | None``, ``bool | str``."""
    if _bool_or_str(tp):
        return "bool | str"
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} | None"
    item = _list_item(tp)
    if item is not None:
        return f"list[{type_name(item)}]"
    return getattr(tp, "__name__", str(tp))


_EXPECTED = {bool: "true or false (or 1 / 0)", int: "an integer", float: "a number", str: "a string"}


def _type_error(name: str, value: Any, expected: str, source: str) -> MindRLHFError:
    return MindRLHFError(f"{source}: {name} = {value!r} is not {expected}")


def coerce_value(value: Any, tp: Any, *, name: str, source: str, aliases: Optional[Dict[str, str]] = None) -> Any:
    """Convert ``value`` (from YAML or a command-line string) to ``tp`` or raise ``MindRLHFError``.

    Accepted: ints for float fields, numeric strings for int/float fields (``"1e-6"``: PyYAML
    reads exponent notation without a dot as a string), ``true``/``false`` (any case) and ``1``/``0``
    for bools, ``none``/``null`` for optional fields given on the command line; for ``bool | str``
    fields a bool spelling gives a bool, ``''`` gives false and any other string is kept (a path).
    Rejected: bools as numbers, floats for int fields, non-finite floats, scalars for list fields.
    """
    if _bool_or_str(tp):
        flag = _as_bool(value)
        if flag is not None:
            return flag
        if isinstance(value, str):  # '' is "nothing to load", as MindRLHF's scripts write it
            return value if value.strip() else False
        raise _type_error(name, value, "true, false or a path", source)
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        return coerce_value(value, inner, name=name, source=source, aliases=aliases)
    item = _list_item(tp)
    if item is not None:
        if not isinstance(value, (list, tuple)):
            raise _type_error(name, value, f"a list of {type_name(item)} (YAML: [a, b]; CLI: --{name} a b)", source)
        return [coerce_value(v, item, name=f"{name}[{i}]", source=source, aliases=aliases) for i, v in enumerate(value)]
    if tp is bool:
        flag = _as_bool(value)
        if flag is None:
            raise _type_error(name, value, _EXPECTED[bool], source)
        return flag
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise _type_error(name, value, _EXPECTED[int], source)
    if tp is float:
        result: Optional[float] = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            result = float(value)
        elif isinstance(value, str):
            try:
                result = float(value.strip())
            except ValueError:
                result = None
        if result is None:
            raise _type_error(name, value, _EXPECTED[float], source)
        if not math.isfinite(result):
            raise _type_error(name, value, "a finite number", source)
        return result
    if tp is str:
        if not isinstance(value, str):
            raise _type_error(name, value, "a string (quote it in YAML)", source)
        if aliases and value in aliases:
            return aliases[value]
        return value
    raise TypeError(f"config field {name}: unsupported type {tp!r}")  # programming error, not user error


#: Settings that were replaced: their old name → how to write them now (the unknown-key errors say so).
RENAMED_KEYS = {"train_jit": "recompute (train_jit true is recompute none, false is recompute full)"}


def _suggest(word: str, candidates: Sequence[str]) -> str:
    if word in RENAMED_KEYS:
        return f" (it was replaced by {RENAMED_KEYS[word]})"
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _fmt(value: Any) -> str:
    """A value as the user would write it in YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if value is None:
        return "null"
    return repr(value)


# ----------------------------------------------------------------------------------------------
# The grouped config
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """Where a field lives and how to parse it."""

    name: str
    group: str
    group_cls: type
    type: Any
    field: dataclasses.Field

    @property
    def help(self) -> str:
        return self.field.metadata["help"]


class GroupedConfig:
    """Mixin for a dataclass whose fields are group dataclasses (see the module docstring).

    Subclasses are dataclasses with one ``field(default_factory=Group)`` per group and implement
    ``_check_combinations(errors)`` for cross-field rules.
    """

    # Text placed after the title in the generated Markdown reference.
    REFERENCE_PREAMBLE: ClassVar[str] = ""
    # The generated reference of this config (a stage's: ``registry.STAGES[name].reference``), named by errors
    # about unknown keys.
    REFERENCE_FILE: ClassVar[str] = "docs/config_reference.md"
    # Fields that moved to another group: {field: the group it was written under before}. A YAML (or a run's
    # recorded config.yaml) that still writes them there loads, with one warning naming the new place.
    MOVED_FIELDS: ClassVar[Dict[str, str]] = {}

    # ---------------------------------------------------------------- introspection
    @classmethod
    def groups(cls) -> List[Tuple[str, type]]:
        """``[(group_name, group_class), ...]`` in declaration order."""
        hints = typing.get_type_hints(cls)
        return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def field_index(cls) -> Dict[str, FieldInfo]:
        """``{field_name: FieldInfo}`` over all groups; checks the names are globally unique."""
        cached = cls.__dict__.get("_field_index_cache")
        if cached is not None:
            return cached
        index: Dict[str, FieldInfo] = {}
        group_names = {g for g, _ in cls.groups()}
        for gname, gcls in cls.groups():
            hints = typing.get_type_hints(gcls)
            for f in dataclasses.fields(gcls):
                if f.name in index:
                    raise TypeError(f"config field {f.name!r} is defined in both {index[f.name].group!r} and {gname!r}")
                if f.name in group_names:
                    raise TypeError(f"config field {f.name!r} in {gname!r} has the name of a group")
                if not f.metadata.get("help"):
                    raise TypeError(f"config field {gname}.{f.name} has no help text")
                if f.default is _MISSING and f.default_factory is _MISSING:
                    raise TypeError(f"config field {gname}.{f.name} has no default")
                index[f.name] = FieldInfo(f.name, gname, gcls, hints[f.name], f)
        cls._field_index_cache = index
        return index

    @classmethod
    def key_alias_index(cls) -> Dict[str, str]:
        """``{alias: field_name}`` of every field's ``key_aliases``; checks they name nothing else."""
        cached = cls.__dict__.get("_key_alias_cache")
        if cached is not None:
            return cached
        index = cls.field_index()
        aliases: Dict[str, str] = {}
        for name, info in index.items():
            # An alias may equal a group's name (``--model PATH`` beside the ``model`` group): ``_flatten``
            # reads a mapping under that key as the group and any other value as the field.
            for alias in info.field.metadata.get("key_aliases", ()):
                if alias in index or alias in aliases:
                    raise TypeError(f"key alias {alias!r} of config field {name!r} is already a name")
                aliases[alias] = name
        cls._key_alias_cache = aliases
        return aliases

    @classmethod
    def defaults(cls) -> Dict[str, Any]:
        """``{field_name: default}`` as this config has them (help and reference show these): a stage may give a
        shared group another default than the field's (``OfflineTrainConfig(output_dir="output/rm")``)."""
        cached = cls.__dict__.get("_defaults_cache")
        if cached is None:
            cfg = cls()
            cached = {name: cfg.get(name) for name in cls.field_index()}
            cls._defaults_cache = cached
        return cached

    def explicitly_set(self) -> frozenset:
        """Names of the fields given by the user (YAML or command line), as opposed to defaults."""
        return frozenset(getattr(self, "_explicit", ()))

    def get(self, name: str) -> Any:
        """The value of field ``name`` whatever its group (``cfg.get("beta")``)."""
        info = self.field_index().get(name)
        if info is None:
            raise KeyError(name)
        return getattr(getattr(self, info.group), name)

    # ---------------------------------------------------------------- dict / YAML
    @classmethod
    def _flatten(cls, data: Any, source: str) -> Dict[str, Tuple[Any, str]]:
        """Grouped, flat or mixed mapping → ``{field: (raw_value, key_as_written)}``."""
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise MindRLHFError(f"{source}: the top level must be a mapping of 'key: value' "
                                f"(got {type(data).__name__})")
        index = cls.field_index()
        aliases = cls.key_alias_index()
        group_names = [g for g, _ in cls.groups()]
        out: Dict[str, Tuple[Any, str]] = {}
        moved: List[Tuple[str, str]] = []  # (key as written, the group it belongs to now)

        def put(name: str, value: Any, written: str) -> None:
            if name in out:
                cls._merge_alias(out, name, value, written, source)
            else:
                out[name] = (value, written)

        for key, value in data.items():
            key_s = str(key)
            # A group may share its name with a field's key alias (group ``model``, ``--model PATH``): a
            # mapping is the group, anything else the field.
            if key_s in group_names and (isinstance(value, dict) or value is None or key_s not in aliases):
                if value is None:  # an empty "algorithm:" section
                    continue
                if not isinstance(value, dict):
                    raise MindRLHFError(f"{source}: group '{key_s}' must be a mapping of 'field: value' "
                                        f"(got {value!r})")
                group_fields = [n for n, i in index.items() if i.group == key_s]
                for sub, sub_value in value.items():
                    sub_s = str(sub)
                    info = index.get(aliases.get(sub_s, sub_s))
                    if info is None:
                        hint = _suggest(sub_s, group_fields) or _suggest(sub_s, list(index))
                        raise MindRLHFError(f"{source}: unknown config key '{key_s}.{sub_s}'{hint}; "
                                            f"see {cls.REFERENCE_FILE}")
                    if info.group != key_s and cls.MOVED_FIELDS.get(info.name) == key_s:
                        moved.append((f"{key_s}.{sub_s}", info.group))
                    elif info.group != key_s:
                        raise MindRLHFError(f"{source}: '{key_s}.{sub_s}': field '{info.name}' belongs to group "
                                            f"'{info.group}'; write '{info.group}: {{{sub_s}: ...}}' or '{sub_s}: ...' "
                                            "at the top level")
                    put(info.name, sub_value, f"{key_s}.{sub_s}")
            elif key_s in index or key_s in aliases:
                put(aliases.get(key_s, key_s), value, key_s)
            else:
                hint = _suggest(key_s, list(index) + group_names)
                raise MindRLHFError(f"{source}: unknown config key '{key_s}'{hint}; see {cls.REFERENCE_FILE}")
        _warn_moved(moved, source)
        return out

    @classmethod
    def regroup(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        """A grouped mapping (``to_dict``'s form, e.g. an older run's config.yaml) with each of ``MOVED_FIELDS``
        written under its old group put under its group now, so it compares with this version's ``to_dict``."""
        out = {g: dict(v) if isinstance(v, dict) else v for g, v in data.items()}
        index = cls.field_index()
        for name, old in cls.MOVED_FIELDS.items():
            if isinstance(out.get(old), dict) and name in out[old]:
                out.setdefault(index[name].group, {})[name] = out[old].pop(name)
        return out

    @classmethod
    def _merge_alias(cls, out: Dict[str, Tuple[Any, str]], name: str, value: Any, written: str, source: str) -> None:
        """A field given a second time: fine as a name and its key alias with equal values, else an error."""
        first_value, first_written = out[name]
        key = written.split(".")[-1].lstrip("-")
        first_key = first_written.split(".")[-1].lstrip("-")
        if key == first_key:  # the same key twice (grouped and flat): never an alias pair
            raise MindRLHFError(f"{source}: '{name}' is set twice (as '{first_written}' and as '{written}'); "
                                "keep one")
        info = cls.field_index()[name]
        values = [coerce_value(v, info.type, name=w, source=source, aliases=info.field.metadata.get("aliases"))
                  for v, w in ((first_value, first_written), (value, written))]
        if values[0] != values[1]:
            which = key if key != name else first_key
            raise MindRLHFError(f"{source}: '{first_written}' = {_fmt(values[0])} and '{written}' = "
                                f"{_fmt(values[1])} differ, but {which} is another name of {name}; keep one")

    def _apply(self, raw: Dict[str, Tuple[Any, str]], source: str) -> None:
        """Coerce and set ``{field: (raw_value, key_as_written)}`` in place (recorded as set by the user)."""
        index = self.field_index()
        explicit = set(getattr(self, "_explicit", ()))
        for name, (value, written) in raw.items():
            info = index[name]
            coerced = coerce_value(value, info.type, name=written, source=source,
                                   aliases=info.field.metadata.get("aliases"))
            setattr(getattr(self, info.group), name, coerced)
            explicit.add(name)
        self._explicit = explicit

    def resolve(self, source: str) -> None:
        """Fill the fields that other inputs determine (subclasses: e.g. a layout read from a file the
        config names). Called once after every source (YAML, flags) is applied, before ``validate``."""

    @classmethod
    def from_dict(cls, data: Dict[str, Any], *, source: str = "config", validate: bool = True):
        """Build from a grouped, flat or mixed mapping; unset fields keep their defaults."""
        cfg = cls()
        cfg._apply(cls._flatten(data, source), source)
        if validate:
            cfg.resolve(source)
            cfg.validate(source=source)
        return cfg

    @classmethod
    def from_yaml(cls, path: "str | os.PathLike[str]", *, validate: bool = True):
        """Load a YAML file (grouped ``algorithm: {beta: 0.04}`` or flat ``beta: 0.04``) and validate it."""
        return cls.from_dict(read_yaml(path), source=str(path), validate=validate)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """``{group: {field: value}}`` (lists copied), the form ``save_yaml`` writes."""
        out: Dict[str, Dict[str, Any]] = {}
        for gname, _ in self.groups():
            group = getattr(self, gname)
            out[gname] = {f.name: _copy(getattr(group, f.name)) for f in dataclasses.fields(group)}
        return out

    def save_yaml(self, path: "str | os.PathLike[str]") -> None:
        """Write the grouped YAML atomically (``from_yaml`` reads it back to an equal config)."""
        text = "# Written by mindrlhf; load with GRPOConfig.from_yaml or --config.\n"
        text += yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        write_text_atomic(path, text, "the config")

    # ---------------------------------------------------------------- command line
    @classmethod
    def build_parser(cls, prog: Optional[str] = None, description: Optional[str] = None) -> argparse.ArgumentParser:
        """An argparse parser with ``--config PATH`` and one ``--<field>`` per field, grouped by group.

        Only flags the user passes appear in the parsed namespace (``argparse.SUPPRESS`` default),
        so they override the YAML without resetting anything else. Values stay strings and are
        converted by ``coerce_value``, the same as YAML values.
        """
        parser = argparse.ArgumentParser(
            prog=prog, description=description, usage="%(prog)s [-h] [--config PATH] [--FIELD VALUE ...]",
            allow_abbrev=False, argument_default=argparse.SUPPRESS,
            formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--config", metavar="PATH",
                            help="YAML config (grouped or flat) loaded first; flags given here override it")
        defaults = cls.defaults()
        for gname, gcls in cls.groups():
            doc = (gcls.__doc__ or "").strip().splitlines()[0] if gcls.__doc__ else None
            group = parser.add_argument_group(gname, doc)
            for info in (i for i in cls.field_index().values() if i.group == gname):
                meta = info.field.metadata
                kwargs: Dict[str, Any] = {"dest": info.name}
                tp = _optional_inner(info.type) or info.type
                help_text = f"{meta['help']} [{type_name(info.type)}; default: {_fmt(defaults[info.name])}]"
                kwargs["help"] = help_text.replace("%", "%%")
                if _bool_or_str(info.type):
                    kwargs.update(nargs="?", const="true", metavar="true|false|PATH")
                elif tp is bool:
                    kwargs.update(nargs="?", const="true", metavar="true|false")
                elif _list_item(tp) is not None:
                    kwargs.update(nargs="*", metavar=type_name(_list_item(tp)).upper())
                elif "cli_const" in meta:
                    kwargs.update(nargs="?", const=meta["cli_const"], metavar=type_name(tp).upper())
                elif "choices" in meta:
                    kwargs["metavar"] = "{" + ",".join(str(c) for c in meta["choices"]) + "}"
                else:
                    kwargs["metavar"] = type_name(tp).upper()
                group.add_argument(f"--{info.name}", **kwargs)
                for alias in meta.get("key_aliases", ()):  # own dest, so a conflict with --name is seen
                    group.add_argument(f"--{alias}", **dict(kwargs, dest=alias, help=f"the same as --{info.name}"))
        return parser

    @classmethod
    def parse_args(cls, argv: Optional[Sequence[str]] = None, *, prog: Optional[str] = None,
                   description: Optional[str] = None, base: Optional["GroupedConfig"] = None):
        """Parse ``argv``: ``--config`` YAML first (or ``base``, a config another reader filled), then the flags
        given; validate; return the config."""
        parser = cls.build_parser(prog=prog, description=description)
        namespace, extras = parser.parse_known_args(argv)
        if extras:
            flags = [a for a in extras if a.startswith("-")]
            if flags:
                bad = flags[0].split("=", 1)[0]
                hint = _suggest(bad.lstrip("-"), list(cls.field_index()) + ["config"])
                hint = hint.replace("'", "'--", 1) if "did you mean" in hint else hint
                raise MindRLHFError(f"command line: unknown option {bad}{hint}; run with --help for the list")
            raise MindRLHFError(f"command line: unexpected argument {extras[0]!r} (options are written --name value)")
        values = vars(namespace)
        config_path = values.pop("config", None)
        index = cls.field_index()
        aliases = cls.key_alias_index()
        source = "command line" + (f" (with --config {config_path})" if config_path else "")
        raw: Dict[str, Tuple[Any, str]] = {}
        for key, value in values.items():
            name = aliases.get(key, key)
            # "--reward_weights none" resets an optional list
            if (_optional_inner(index[name].type) is not None and isinstance(value, list) and len(value) == 1
                    and value[0].strip().lower() in ("none", "null")):
                value = None
            if name in raw:
                cls._merge_alias(raw, name, value, f"--{key}", "command line")
            else:
                raw[name] = (value, f"--{key}")
        if base is not None and config_path:
            raise MindRLHFError(f"command line: --config {config_path} is given twice; keep one")
        cfg = base if base is not None else cls.from_yaml(config_path, validate=False) if config_path else cls()
        cfg._apply(raw, source)
        cfg.resolve(source)
        cfg.validate(source=source)
        return cfg

    # ---------------------------------------------------------------- validation
    def _check_fields(self, errors: List[str]) -> None:
        """Types, choices and declarative bounds of every field."""
        for name, info in self.field_index().items():
            meta = info.field.metadata
            value = getattr(getattr(self, info.group), name)
            if not _is_instance(value, info.type):  # e.g. a value assigned in Python
                errors.append(f"{name} = {value!r} is not of type {type_name(info.type)}")
                continue
            if value is None:
                continue
            if "choices" in meta and value not in meta["choices"]:
                choices = "|".join(str(c) for c in meta["choices"])
                hint = _suggest(str(value), [str(c) for c in meta["choices"]])
                errors.append(f"{name} = {value!r} is not one of {choices}{hint}")
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                label = f"{name}[{i}]" if isinstance(value, list) else name
                if isinstance(item, bool) or not isinstance(item, (int, float)):
                    continue
                for key, ok, text in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                                      ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
                    if key in meta and not ok(item, meta[key]):
                        errors.append(f"{label} = {item!r} must be {text} {meta[key]!r}")

    def _check_combinations(self, errors: List[str]) -> None:
        """Cross-field rules; subclasses append one message per violated rule."""

    def validate(self, source: Optional[str] = None) -> None:
        """Raise ``MindRLHFError`` listing every invalid value or combination (one line)."""
        errors: List[str] = []
        self._check_fields(errors)
        if not errors:  # cross-field rules assume each field is individually valid
            self._check_combinations(errors)
        if errors:
            where = f" ({source})" if source else ""
            raise MindRLHFError(f"invalid config{where}: " + "; ".join(errors))

    # ---------------------------------------------------------------- documentation
    @classmethod
    def reference_markdown(cls, title: str = "Configuration reference") -> str:
        """The Markdown reference: one table per group (field, type, default, description)."""
        lines = [f"# {title}", "",
                 "<!-- Generated by mindrlhf.configs.write_config_references(); do not edit. -->", ""]
        if cls.REFERENCE_PREAMBLE:
            lines += [cls.REFERENCE_PREAMBLE.strip(), ""]
        defaults = cls.defaults()
        for gname, gcls in cls.groups():
            lines += [f"## `{gname}` ({gcls.__name__})", ""]
            if gcls.__doc__:
                lines += [" ".join(gcls.__doc__.split()), ""]
            lines += ["| Field | Type | Default | Description |", "|---|---|---|---|"]
            for info in (i for i in cls.field_index().values() if i.group == gname):
                text = info.help
                if "choices" in info.field.metadata:
                    text += " Choices: " + ", ".join(f"`{c}`" for c in info.field.metadata["choices"]) + "."
                if "key_aliases" in info.field.metadata:
                    text += " Alias: " + ", ".join(f"`{a}`" for a in info.field.metadata["key_aliases"]) + "."
                cells = [f"`{info.name}`", f"`{type_name(info.type)}`", f"`{_fmt(defaults[info.name])}`", text]
                text_cells = [cells[0], cells[1], cells[2], _md_text(cells[3])]
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in text_cells) + " |")
            lines.append("")
        return "\n".join(lines)


def read_yaml(path: "str | os.PathLike[str]") -> Any:
    """A config file's YAML (``yaml.safe_load``); a missing file or bad syntax is one ``MindRLHFError``."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MindRLHFError(f"config file not found: {source}") from None
    except OSError as err:
        raise MindRLHFError(f"cannot read config file {source}: {err.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise MindRLHFError(f"{source}:{where}: {problem}; fix the YAML syntax") from None


def _warn_moved(moved: List[Tuple[str, str]], source: str) -> None:
    """One warning per process for the moved fields a config still writes under their old group."""
    by_group: Dict[str, List[str]] = {}
    for key, group in moved:
        if key not in _WARNED_MOVED:
            _WARNED_MOVED.add(key)
            by_group.setdefault(group, []).append(key)
    for group, keys in by_group.items():
        field = keys[0].split(".")[-1]
        log.warning("%s: %s moved to the '%s' group; read from the old place this time, write '%s: {%s: ...}' (or "
                    "the keys at the top level) from now on", source, ", ".join(keys), group, group, field)


def _md_text(text: str) -> str:
    """Plain help text for a Markdown table cell: '<' would start an HTML tag (<think>)."""
    return text.replace("<", "&lt;")


def _is_instance(value: Any, tp: Any) -> bool:
    """Strict type check of an already-coerced value (ints count as floats, bools as nothing else)."""
    if _bool_or_str(tp):
        return isinstance(value, (bool, str))
    inner = _optional_inner(tp)
    if inner is not None:
        return value is None or _is_instance(value, inner)
    item = _list_item(tp)
    if item is not None:
        return isinstance(value, list) and all(_is_instance(v, item) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, tp)


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
