"""The rollout tools: the calculator's arithmetic and bounds (hand-computed), tool schemas equal to transformers'
``get_json_schema``, the Hermes parser, and ``ToolBox``'s failures (malformed, unknown, bad arguments, raising,
timing out), which are results and counts, never exceptions."""
from __future__ import annotations

import enum
import json
import threading
import time
from typing import Dict, List, Literal, Optional, Tuple, Union

import pytest

from mindrlhf.errors import MindRLHFError
from mindrlhf.rewards import get_reward_fn
from mindrlhf.rollout_tools import (
    TOOLS,
    TRUNCATED,
    ToolBox,
    ToolCall,
    ToolCallError,
    ToolError,
    ToolTimeout,
    call_with_timeout,
    get_tool,
    parse_tool_calls,
    tool_schema,
)
from mindrlhf.rollout_tools.builtin import MAX_EXPONENT, calculator


# --- calculator ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression, expected", [
    ("48/2", "24"),                 # a whole quotient reads as GSM8K writes it
    ("(48 + 12) / 2", "30"),
    ("7 // 2", "3"), ("-7 // 2", "-4"), ("7 % 3", "1"), ("-7 % 3", "2"),  # Python's floor semantics
    ("2 ** 10", "1024"), ("2 ** -2", "0.25"), ("-2 ** 2", "-4"), ("(-2) ** 2", "4"),
    ("1 / 3", "0.333333333333"),    # twelve significant digits
    ("0.1 + 0.2", "0.3"),
    ("3 * 4.5", "13.5"), ("1e3 + 1", "1001"), ("  5 - - 3 ", "8"), ("+4", "4"),
    ("10 ** 30", str(10 ** 30)),    # the largest number allowed
    ("2.5e20 * 2", "5e+20"),        # a whole float too large to write as an int
    ("1_000 * 3", "3000"),
])
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 101", f"exponent too large (the limit is {MAX_EXPONENT})"),
    ("9 ** 9 ** 9", "exponent too large"),              # right-associative: 9 ** 387420489 is never computed
    ("10 ** 30 + 1", "number too large (the limit is 1e30)"),
    ("2 ** 100", "number too large"), ("1e31", "number too large"), ("1e308 * 10", "number too large"),
    ("10.0 ** 31", "number too large"), ("1e300 ** 2", "number too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("2 ^ 3", "unsupported operator ^ (write powers as **)"),
    ("x + 1", "unknown name 'x'"),
    ("abs(-3)", "unsupported expression Call"),
    ("__import__('os')", "unsupported expression Call"),
    ("'a' * 3", "'a' is not a number"), ("True + 1", "True is not a number"),
    ("1 < 2", "unsupported expression Compare"),
    ("(1, 2)", "unsupported expression Tuple"),
    ("2 +", "invalid expression"),
    ("1" + "+1" * 100, "longer than 200 characters"),
])
def test_calculator_errors_are_one_line_tool_errors(expression, message):
    with pytest.raises(ToolError) as err:
        calculator(expression)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_calculator_is_the_registered_builtin():
    assert "calculator" in TOOLS.names() and get_tool("calculator") is calculator


# --- registry: the reward functions' resolver ----------------------------------------------------------------------
def test_user_tool_by_dotted_path_and_errors(tmp_path, monkeypatch):
    (tmp_path / "mindrlhf_test_user_tools.py").write_text(
        "def lookup(key: str) -> str:\n"
        "    '''Look a key up.\n\n    Args:\n        key: The key.\n    '''\n"
        "    return {'a': 'apple'}.get(key, 'none')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_tool("mindrlhf_test_user_tools:lookup")
    assert fn("a") == "apple" and get_tool("mindrlhf_test_user_tools.lookup") is fn
    with pytest.raises(MindRLHFError, match=r"unknown tool 'calc'; built-ins: calculator; or give a user function"):
        get_tool("calc")
    with pytest.raises(MindRLHFError, match="tool 'no_such_pkg_xyz:f': cannot import module 'no_such_pkg_xyz'"):
        get_tool("no_such_pkg_xyz:f")
    with pytest.raises(MindRLHFError, match="has no callable 'missing'"):
        get_tool("mindrlhf_test_user_tools:missing")
    # the one resolver serves the reward functions too, with their own kind in its errors
    with pytest.raises(MindRLHFError, match="unknown reward function 'calculator'"):
        get_reward_fn("calculator")


# --- schema: parity with transformers.utils.get_json_schema -------------------------------------------------------
class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


def _plain(x: int, y: float) -> float:
    """Multiply two numbers.

    Args:
        x: The first number.
        y: The second number,
            continued on a second line.
    """
    return x * y


def _typed(query: str, limit: Optional[int] = None, tags: List[str] = (), weights: Dict[str, float] = None,
           pair: Tuple[int, str] = (0, ""), mode: Literal["fast", "exact"] = "fast", colour: Colour = Colour.RED,
           either: Union[int, str] = 0, nested: Optional[List[Dict[str, int]]] = None, unit: str = "cm",
           flag: bool = False) -> Dict[str, int]:
    """Search something.

    A second paragraph of description.

    Args:
        query: What to look for.
        limit (int): How many results at most.
        tags: Tags to filter on.
        weights: A weight per field.
        pair: A pair.
        mode: How to search.
        colour: A colour.
        either: An int or a string.
        nested: Lists of counts.
        unit: The unit (choices: ["cm", "in"])
        flag: Whether to flag.

    Returns:
        Counts by name.

    Raises:
        ValueError: never.
    """
    return {}


class _Env:
    def move(self, steps: int) -> str:
        """Move.

        Args:
            steps: How far.
        """
        return ""


@pytest.mark.parametrize("fn", [calculator, _plain, _typed, _Env().move, _Env.move], ids=lambda f: f.__qualname__)
def test_schema_equals_transformers(fn):
    transformers_utils = pytest.importorskip("transformers.utils")
    assert tool_schema(fn) == transformers_utils.get_json_schema(fn)


def test_schema_of_the_calculator_by_hand():
    assert tool_schema(calculator)["function"]["parameters"] == {
        "type": "object", "required": ["expression"],
        "properties": {"expression": {"type": "string", "description": 'The expression, with numbers, + - * / // % ** '
                                                                      'and parentheses, e.g. "(48 + 12) / 2".'}}}


def _undocumented(x: int) -> int:
    return x


def _untyped(x):
    """Nothing.

    Args:
        x: A thing.
    """


def _missing_arg_doc(x: int, y: int) -> int:
    """Add.

    Args:
        x: A number.
    """
    return x + y


class Custom:
    pass


def _custom(x: Custom) -> int:
    """Use a custom class.

    Args:
        x: A custom object.
    """
    return 0


@pytest.mark.parametrize("fn, message", [
    (_undocumented, "tool '_undocumented' has no docstring"),
    (_untyped, "argument 'x' has no type hint"),
    (_missing_arg_doc, "the docstring has no 'Args:' line for 'y'"),
    (_custom, "has no JSON schema"),
])
def test_schema_errors_are_one_line(fn, message):
    with pytest.raises(MindRLHFError, match=message) as err:
        tool_schema(fn)
    assert "\n" not in str(err.value)
    utils = pytest.importorskip("transformers.utils.chat_template_utils")  # transformers refuses the same functions
    with pytest.raises((utils.TypeHintParsingException, utils.DocstringParsingException)):
        utils.get_json_schema(fn)


# --- Hermes parser -------------------------------------------------------------------------------------------------
def test_parser_reads_calls_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "48/2"}}\n</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>'
            '<tool_call>{"name": "noargs"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "48/2"}), ToolCall("lookup", {"key": "a"}),
                                      ToolCall("noargs", {})]
    assert parse_tool_calls("The answer is 24.") == []


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{'name': 'calculator'}</tool_call>", "not JSON (Expecting property name enclosed in double quotes"),
    ("<tool_call>[1, 2]</tool_call>", "expected a JSON object with 'name' and 'arguments', got list"),
    ('<tool_call>{"arguments": {}}</tool_call>', "no 'name' string"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "'arguments' must be an object, got list"),
    ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', "'arguments' is a string but not JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "<tool_call> without </tool_call>"),
])
def test_parser_errors(text, message):
    (call,) = parse_tool_calls(text)
    assert isinstance(call, ToolCallError) and message in call.message


# --- ToolBox: every failure a result ------------------------------------------------------------------------------
def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _boom(x: int) -> str:
    """Raise.

    Args:
        x: Ignored.
    """
    raise RuntimeError("the tool broke\nover two lines")


def _sleeper(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def _stubborn(seconds: float) -> str:
    """Catch everything and finish late.

    Args:
        seconds: How long.
    """
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.01)
        except BaseException:  # noqa: B036 - the point of the test
            pass
    return "late"


def _long(n: int) -> List[int]:
    """A long list.

    Args:
        n: How many.
    """
    return list(range(n))


def test_toolbox_results_and_failures():
    box = ToolBox(["calculator", _boom, _long], timeout=2, max_response_length=20)
    assert box.names == ["calculator", "_boom", "_long"] and len(box.schemas) == 3
    text = (_call("calculator", expression="6*7") + _call("calc", expression="1") + "<tool_call>{bad}</tool_call>"
            + _call("calculator", expr="1") + _call("calculator", expression=42) + _call("calculator", expression="1/0")
            + _call("_boom", x=1) + _call("_long", n=3) + _call("_long", n=100))
    results = box.run(text)
    assert [(r.content, r.failed) for r in results] == [
        ("42", False),
        ("error: unknown tool 'calc'; the tools are calculator, _boom, _long"[:20] + TRUNCATED, True),
        ("error: malformed too" + TRUNCATED, True),
        ("error: bad arguments" + TRUNCATED, True),
        ("error: bad arguments" + TRUNCATED, True),
        ("error: division by z" + TRUNCATED, True),
        ("error: RuntimeError:" + TRUNCATED, True),
        ("[0, 1, 2]", False),
        ("[0, 1, 2, 3, 4, 5, 6" + TRUNCATED, True)[:1] + (False,),
    ]
    whole = ToolBox(["calculator", _boom], timeout=2, max_response_length=0)
    assert [r.content for r in whole.run(_call("calculator", expr="1") + _call("calculator", expression=42)
                                         + _call("_boom", x=1))] == [
        "error: bad arguments for 'calculator': unknown argument 'expr'; it takes expression",
        "error: bad arguments for 'calculator': 'expression' must be string, got 42",
        "error: RuntimeError: the tool broke over two lines"]
    assert whole.run(_call("calculator"))[0].content == (
        "error: bad arguments for 'calculator': missing a required argument: 'expression'")


def test_a_hanging_tool_stops_at_the_timeout():
    box = ToolBox([_sleeper, _stubborn], timeout=0.3, max_response_length=0)
    start = time.monotonic()
    (result,) = box.run(_call("_sleeper", seconds=30))
    assert time.monotonic() - start < 2 and result.failed
    assert result.content == "error: '_sleeper' timed out after 0.3 s"
    (late,) = box.run(_call("_stubborn", seconds=0.6))  # swallows ToolTimeout and returns late: still a timeout
    assert late.failed and "timed out" in late.content
    assert box.run(_call("_sleeper", seconds=0.01))[0].content == "woke"


def test_the_timeout_restores_a_running_timer():
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(ToolTimeout):
            call_with_timeout(_sleeper, {"seconds": 5}, 0.2)
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 0.5 < remaining < 0.85 and signal.getsignal(signal.SIGALRM) is not None
        time.sleep(remaining + 0.2)
        assert fired == [1]  # the outer timer went off, with its own handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_a_python_loop_is_stopped():
    ticks = []

    def spin(n: int) -> str:
        """Spin.

        Args:
            n: Unused.
        """
        while True:
            ticks.append(1)
            time.sleep(0.005)

    out = {}
    worker = threading.Thread(target=lambda: out.update(result=ToolBox([spin], timeout=0.2).run(_call("spin", n=1))))
    worker.start()
    worker.join(5)
    assert out["result"][0].content == "error: 'spin' timed out after 0.2 s"
    time.sleep(0.1)
    count = len(ticks)
    time.sleep(0.2)
    assert len(ticks) == count  # the loop was stopped, not left running


def test_toolbox_refuses_what_it_cannot_offer():
    with pytest.raises(MindRLHFError, match="two tools are named 'calculator'"):
        ToolBox(["calculator", calculator])

    async def coro(x: int) -> str:
        """Async.

        Args:
            x: A number.
        """
        return ""

    with pytest.raises(MindRLHFError, match="async function"):
        ToolBox([coro])
    with pytest.raises(MindRLHFError, match="must be >= 0"):
        ToolBox(["calculator"], timeout=-1)


def test_an_environments_toolbox_calls_its_own_instance_with_the_schemas_read_once():
    """Every completion's toolbox binds its own instance's methods to the schemas the class gave once (the same
    objects, not read again per completion); a schema list that does not match the tools is refused."""
    from mindrlhf.rollout_tools.environment import Environment
    from tool_envs import CalculatorEnv

    env, run_tools = Environment(CalculatorEnv), ToolBox([])
    a, b = env.start({"solution": "24"}), env.start({"solution": "42"})
    box_a, box_b = env.toolbox(a, run_tools), env.toolbox(b, run_tools)
    assert box_a.schemas == box_b.schemas == ToolBox(env.tools(a)).schemas
    assert all(x is y for x, y in zip(box_a.schemas, env.schemas))
    assert box_a.run('<tool_call>{"name": "calculator", "arguments": {"expression": "48 / 2"}}</tool_call>')[0] \
        .content == "24"
    assert (env.reward(a), env.reward(b)) == (1.0, 0.0)
    with pytest.raises(MindRLHFError, match="ToolBox got 2 schemas for 1 tools; give one per tool"):
        ToolBox(["calculator"], schemas=env.schemas * 2)
