"""Final-answer extraction and number parsing for math completions (GSM8K-style answers).

``extract_answer`` picks the final answer of a completion, in this order: the last
``<answer>…</answer>`` block, else the last ``\\boxed{…}`` (nested braces allowed), else the text
after the last ``#### ``, else the last number in the text. Inside a block/box/``####`` line that
is not itself a number (``"18 dollars"``, ``"x = 5"``) the last number in it is taken.

``parse_number`` turns an answer string into a float, tolerating ``$``, thousands commas, a
trailing ``.``/``%``, unicode minus, ``\\text{…}`` units, ``a/b`` and ``\\frac{a}{b}``.
"""
from __future__ import annotations

import math
import re
from typing import Optional, Tuple

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASH = re.compile(r"####[ \t]*([^\n]*)")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number in running text: \frac{a}{b}, or [-][$]digits (thousands groups)[.decimals][/denominator][%].
# A "-" is a sign only when not glued to a preceding word/closing bracket ("16-3" is 16 minus 3).
_TEXT_NUMBER = re.compile(
    r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"
    r"|(?:(?<![\w)\]])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?%?"
)
_DECIMAL = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_SLASH = re.compile(r"([^/]+)/([^/]+)")

ANSWER_REL_TOL = 1e-6


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{…}`` with balanced braces, or None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def _last_number(text: str) -> Optional[str]:
    found = _TEXT_NUMBER.findall(text)
    return found[-1] if found else None


def _refine(candidate: Optional[str]) -> Optional[str]:
    """The candidate if it is a number; else the last number inside it; else the stripped text."""
    if candidate is None:
        return None
    candidate = candidate.strip()
    if not candidate:
        return None
    if parse_number(candidate) is not None:
        return candidate
    return _last_number(candidate) or candidate


def locate_answer(text: str) -> Tuple[Optional[str], Optional[str]]:
    """``(answer, source)``: the final answer and where it came from.

    ``source`` is ``"boxed"`` (a ``\\boxed{}``, also inside an ``<answer>`` block), ``"answer_tag"``,
    ``"hash"`` (``#### N``), ``"last_number"``, or None when nothing was found.
    """
    if not isinstance(text, str):
        return None, None
    tags = _ANSWER_TAG.findall(text)
    if tags:
        boxed = _last_boxed(tags[-1])
        if boxed is not None:
            return _refine(boxed), "boxed"
        return _refine(tags[-1]), "answer_tag"
    boxed = _last_boxed(text)
    if boxed is not None:
        return _refine(boxed), "boxed"
    hashes = _HASH.findall(text)
    if hashes and hashes[-1].strip():
        return _refine(hashes[-1]), "hash"
    number = _last_number(text)
    return (number, "last_number") if number is not None else (None, None)


def extract_answer(text: str) -> Optional[str]:
    """The final answer string of a completion (see the module docstring for the order), or None."""
    return locate_answer(text)[0]


def parse_number(s) -> Optional[float]:
    """A float from an answer string (``"$1,000"``, ``"18."``, ``"-3"``, ``"50%"``, ``"3/4"``,
    ``"\\frac{3}{4}"``), or None when it is not a single number."""
    if s is None:
        return None
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return float(s) if math.isfinite(s) else None
    s = str(s).strip()
    s = re.sub(r"\\text\s*\{[^{}]*\}", "", s)  # units: 42\text{ apples}
    for old, new in (("\\!", ""), ("\\,", ""), ("{,}", ","), ("\\$", ""), ("$", ""), ("\\%", "%"), ("\u2212", "-")):
        s = s.replace(old, new)
    s = s.strip()
    while s.startswith("{") and s.endswith("}"):
        s = s[1:-1].strip()
    s = s.rstrip(".%").strip()  # "18." (end of sentence), "50%"
    if not s:
        return None
    frac = _FRAC.fullmatch(s)
    if frac:
        sign, num, den = frac.groups()
        value = _ratio(parse_number(num), parse_number(den))
        return None if value is None else (-value if sign == "-" else value)
    slash = _SLASH.fullmatch(s)
    if slash:
        num, den = slash.groups()
        if _DECIMAL.fullmatch(num.strip()) and _DECIMAL.fullmatch(den.strip()):
            return _ratio(parse_number(num), parse_number(den))
        return None
    if _DECIMAL.fullmatch(s):
        return float(s.replace(",", ""))
    return None


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or den == 0:
        return None
    return num / den


def numbers_match(a: float, b: float, rel_tol: float = ANSWER_REL_TOL) -> bool:
    """Integers compare exactly (1450001 != 1450000 although they are 7e-7 apart, relatively);
    other values up to a relative tolerance (and a tiny absolute one, so 0 == 1e-12)."""
    if float(a).is_integer() and float(b).is_integer():
        return a == b
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)
