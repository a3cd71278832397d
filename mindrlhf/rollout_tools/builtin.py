"""The built-in tools. ``calculator``: arithmetic read through ``ast`` (never ``eval``), with bounded numbers."""
from __future__ import annotations

import ast
import math
import operator
from typing import Callable, Dict, Union

from mindrlhf.rollout_tools.registry import ToolError, register_tool

#: The longest expression the calculator reads (characters): keeps ``ast.parse`` and the walk small.
MAX_EXPRESSION_LENGTH = 200
#: The largest magnitude of any number, written or computed (an int's or a float's absolute value).
MAX_MAGNITUDE = 10 ** 30
#: The largest absolute exponent of ``**``, checked before the power is computed.
MAX_EXPONENT = 100
#: Significant digits of a float result (so 0.1 + 0.2 reads 0.3).
FLOAT_DIGITS = 12

Number = Union[int, float]
_BINARY: Dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_SYMBOLS = {ast.BitXor: "^ (write powers as **)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
            ast.RShift: ">>", ast.MatMult: "@"}


def _bounded(value: Number) -> Number:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"number too large (the limit is 1e{len(str(MAX_MAGNITUDE)) - 1})")
    return value


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass; strings, None, complex are not numbers
            raise ToolError(f"{node.value!r} is not a number")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        op = type(node.op)
        if op not in _BINARY:
            raise ToolError(f"unsupported operator {_SYMBOLS.get(op, op.__name__)}; use + - * / // % **")
        left, right = _evaluate(node.left), _evaluate(node.right)
        if op is ast.Pow and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent too large (the limit is {MAX_EXPONENT})")
        try:
            return _bounded(_BINARY[op](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"number too large (the limit is 1e{len(str(MAX_MAGNITUDE)) - 1})") from None
    if isinstance(node, ast.Name):
        raise ToolError(f"unknown name {node.id!r}; the calculator reads numbers only")
    raise ToolError(f"unsupported expression {type(node).__name__}; use numbers, + - * / // % ** and parentheses")


def format_number(value: Number) -> str:
    """How the calculator writes a result: an int as is, a float to ``FLOAT_DIGITS`` significant digits, a whole
    float as an int (``48/2`` is ``24``, as GSM8K's annotations write it)."""
    if isinstance(value, int):
        return str(value)
    value = float(f"{value:.{FLOAT_DIGITS}g}")
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: The expression, with numbers, + - * / // % ** and parentheses, e.g. "(48 + 12) / 2".

    Returns:
        The result as a number.
    """
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"invalid expression ({err.msg})") from None
    return format_number(_evaluate(tree))
