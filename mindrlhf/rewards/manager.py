"""Weighted sum of reward functions, called with TRL's reward-function arguments."""
from __future__ import annotations

import logging
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from mindrlhf.errors import MindRLHFError
from mindrlhf.rewards.registry import REWARD_FUNCS, RewardFn, get_reward_fn

logger = logging.getLogger(__name__)

#: What a reward function that raises does to the run: stop it, or score that call None and go on.
REWARD_ERRORS = ("raise", "skip")
#: The largest reward kept: rewards are float32 (as in TRL); a larger one would be stored as inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def reward_name(spec: Union[str, RewardFn], fn: RewardFn) -> str:
    """The name a reward is logged under (``rewards/<name>/mean``), as TRL names it: a built-in's registry
    name (``accuracy``), else the function's ``__name__`` (``my_rewards:length_parity`` -> ``length_parity``)."""
    if isinstance(spec, str) and spec in REWARD_FUNCS:
        return spec
    return getattr(fn, "__name__", None) or repr(fn)


def reward_spec_name(spec: str) -> str:
    """``reward_name`` of a ``reward_funcs`` entry without importing it: a built-in's name, else the function
    part of the dotted path (configs check names with it before anything loads; the manager checks ``__name__``)."""
    if spec in REWARD_FUNCS or not isinstance(spec, str):
        return spec
    return spec.rpartition(":")[2] if ":" in spec else spec.rpartition(".")[2]


def _short(value, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (a one-line error must stay one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _shown(spec: Union[str, RewardFn], fn: RewardFn) -> str:
    """A spec as given, or where a callable is defined (``module:qualname``)."""
    if isinstance(spec, str):
        return spec
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


class RewardManager:
    """Scores completions with several reward functions and combines them with weights.

    ``funcs``: built-in names, ``"package.module:function"`` paths, or callables. ``weights``: one
    per function (default all 1.0). ``names``: each function's name as TRL logs it (``reward_name``);
    two functions of one name are an error. Every function is called as TRL calls its reward functions:
    ``fn(prompts=, completions=, completion_ids=, **dataset_columns)`` (here ``solution``,
    ``question``), all by keyword. ``errors``: a function that raises stops the run with one error
    naming it (``"raise"``), or (``"skip"``) every sample of that call scores None,
    ``failures[name]`` counts the failed calls and the first failure of each function is logged
    (warning, with traceback). A value that is not a number (a string, as TRL refuses it; numbers are float,
    int, bool and numpy scalars), not finite (inf, NaN) or beyond float32's range, and a weighted sum beyond it,
    are failures too, under the same policy (with skip, those samples score None); None itself is a function's
    way to give no score.
    """

    def __init__(self, funcs: Sequence[Union[str, RewardFn]], weights: Optional[Sequence[float]] = None,
                 errors: str = "raise"):
        if errors not in REWARD_ERRORS:
            raise MindRLHFError(f"reward_errors={errors!r} is not one of {', '.join(REWARD_ERRORS)}")
        self.errors = errors
        if isinstance(funcs, str) or not funcs:
            raise MindRLHFError(f"reward funcs must be a non-empty list, e.g. ['accuracy', 'format']; got {funcs!r}")
        self.names: List[str] = []
        self.funcs: List[RewardFn] = []
        #: What the user gave for each name (a built-in name or a dotted path; a callable's name): errors show
        #: it, so the function is easy to find.
        self.specs: Dict[str, str] = {}
        for spec in funcs:
            fn = spec if callable(spec) else get_reward_fn(spec)
            name = reward_name(spec, fn)
            if name in self.specs:
                first, second = self.funcs[self.names.index(name)], fn
                what = "is listed twice in reward funcs" if first is second else \
                    f"names two functions, {self.specs[name]!r} and {_shown(spec, fn)!r}; rename one of them"
                raise MindRLHFError(f"reward function {name!r} {what} (each is logged as rewards/<name>/mean)")
            self.names.append(name)
            self.specs[name] = spec if isinstance(spec, str) else name
            self.funcs.append(fn)
        if weights is None:
            weights = [1.0] * len(self.funcs)
        if len(weights) != len(self.funcs):
            raise MindRLHFError(
                f"reward weights has {len(weights)} values for {len(self.funcs)} reward funcs {self.names}; "
                "give one per function"
            )
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
            raise MindRLHFError(f"reward weights must be finite numbers, got {list(weights)}")
        self.weights = np.asarray(weights, dtype=np.float64)
        self.failures: Dict[str, int] = {name: 0 for name in self.names}
        self._logged: set = set()

    def for_evaluation(self) -> "RewardManager":
        """The same functions, names and weights with their own failure counts and ``errors="skip"``: what scores
        an evaluation's completions (a function that cannot score held-out questions gives NaN there instead of
        stopping the run, and its failures are not counted as the training rollouts')."""
        import copy

        other = copy.copy(self)
        other.errors, other.failures, other._logged = "skip", {name: 0 for name in self.names}, set()
        return other

    def __call__(
        self, completions: Sequence[str], solution: Sequence[str], *, prompts: Optional[Sequence[str]] = None,
        completion_ids: Optional[Sequence[Sequence[int]]] = None, **columns
    ) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
        """``(total (B,) float32, {name: (B,) float32})``; None scores are NaN in ``per_fn``.

        ``prompts`` (text) and ``completion_ids`` (token ids) are passed on with ``columns`` (lists of
        B values each). ``total`` is the weighted sum over the functions that scored a sample (NaN
        terms are skipped); it is NaN when no function scored it (or, under skip, the sum overflowed float32),
        which the advantage code excludes.
        """
        n = len(completions)
        kwargs = dict(columns, prompts=prompts, completions=completions, completion_ids=completion_ids,
                      solution=solution)
        for key, values in kwargs.items():
            if values is not None and len(values) != n:
                raise MindRLHFError(f"reward inputs: {len(values)} values of {key!r} for {n} completions")
        per_fn = {name: self._score(name, fn, kwargs) for name, fn in zip(self.names, self.funcs)}
        scores = np.stack([per_fn[name] for name in self.names]).astype(np.float64)  # (F, B)
        weighted = np.where(np.isnan(scores), 0.0, scores * self.weights[:, None])
        total = np.where(np.isnan(scores).all(axis=0), np.nan, weighted.sum(axis=0))
        over = np.abs(total) > FLOAT32_MAX  # finite terms whose weighted sum float32 would store as inf
        if over.any():
            self._overflowed(np.where(np.isnan(scores), np.nan, weighted), total, over)
            total[over] = np.nan
        return total.astype(np.float32), per_fn

    def _overflowed(self, weighted: np.ndarray, total: np.ndarray, over: np.ndarray) -> None:
        """The weighted sum of finite rewards is beyond float32's range: a reward failure under ``errors``,
        counted against the function with the largest weighted term (under skip those samples score None).
        ``weighted``: (functions, samples), NaN where a function gave no score."""
        i = int(np.flatnonzero(over)[0])
        name = self.names[int(np.nanargmax(np.abs(weighted[:, i])))]
        terms = ", ".join(f"{n!r} {w:.4g}" for n, w in zip(self.names, weighted[:, i]) if not np.isnan(w))
        what = (f"made the weighted reward {total[i]:.4g} for completion {i} ({int(over.sum())} of {len(total)} beyond "
                f"float32's range; weighted terms: {terms})")
        if self.errors == "raise":
            raise MindRLHFError(f"reward function {self.specs[name]!r} {what}; scale the rewards or reward_weights "
                                "down, or set reward_errors: skip to score such completions None and train on")
        self._failed(name, what)

    def _score(self, name: str, fn: Callable, kwargs: Dict[str, Sequence]) -> np.ndarray:
        n = len(kwargs["completions"])
        try:
            out = fn(**kwargs)
        except Exception as err:
            if self.errors == "raise":
                raise MindRLHFError(
                    f"reward function {self.specs[name]!r} raised {type(err).__name__}: {err}; fix the function (it is "
                    f"called as fn(prompts=, completions=, completion_ids=, solution=, question=), so it needs "
                    f"**kwargs), or set reward_errors: skip to score such calls None and train on"
                ) from err
            # skip: a user reward bug does not kill a long run; score None, count, log once
            self._failed(name, "raised", exc_info=True)
            return np.full(n, np.nan, dtype=np.float32)
        try:
            length = len(out)
        except TypeError:
            length = None
        if length != n:
            raise MindRLHFError(
                f"reward function {self.specs[name]!r} returned {length if length is not None else type(out).__name__} "
                f"values for {n} completions; it must return one float or None per completion"
            )
        # What TRL's GRPOTrainer accepts (torch.tensor(values, dtype=float32)): numbers (float, int, bool, numpy
        # scalars) and None. Python's float() would also turn a string "0.5" into a number, which TRL refuses;
        # here a string, like any value that is not a number, is a failure of the function.
        values = np.full(n, np.nan, dtype=np.float64)
        problem: List[Optional[str]] = [None] * n
        for i, v in enumerate(out):
            if v is None:
                continue
            try:
                if isinstance(v, (str, bytes, bytearray)):
                    raise TypeError
                values[i] = float(v)
            except (TypeError, ValueError):
                problem[i] = "not numbers"
                continue
            # inf, NaN, or a value beyond float32's range (rewards are kept as float32, as in TRL): one such value
            # would make its whole group's std NaN and every advantage of the group 0, training nothing without a
            # word. A failure of the function, like an exception (None is how a function says "no score").
            if not math.isfinite(values[i]):
                problem[i] = "non-finite"
            elif abs(values[i]) > FLOAT32_MAX:
                problem[i] = "beyond float32's range"
        bad = np.array([p is not None for p in problem])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            kind = problem[i]
            shown = repr(out[i]) if kind != "not numbers" else f"a {type(out[i]).__name__} ({_short(out[i])})"
            what = f"returned {shown} for completion {i} ({problem.count(kind)} of {n} {kind})"
            if self.errors == "raise":
                fix = {"non-finite": "return a finite float", "not numbers": "return a float, int or bool (as TRL)",
                       "beyond float32's range": "scale the reward down (rewards are float32, |r| <= 3.4e38)"}[kind]
                raise MindRLHFError(f"reward function {self.specs[name]!r} {what}; {fix}, or None for no score, or set "
                                    "reward_errors: skip to score such values None and train on")
            self._failed(name, what)
            values[bad] = np.nan
        return values.astype(np.float32)

    def _failed(self, name: str, what: str, exc_info: bool = False) -> None:
        """reward_errors skip: count the failed call; log the first failure of each function."""
        self.failures[name] += 1
        if name not in self._logged:
            self._logged.add(name)
            logger.warning("reward function %r %s; those scores are None (later failures are only counted, in "
                           "rewards/%s/failures)", self.specs[name], what, name, exc_info=exc_info)
