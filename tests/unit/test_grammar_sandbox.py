"""Grammar work where a timeout really stops it (shared/grammar_sandbox.py), the gateway's grammar
check run there (shared/grammar_text.py), and the cost bounds checked before any library runs
(shared/grammar_limits.py, shared/grammar_finite.py). No bus, no model."""

from __future__ import annotations

import importlib
import os
import random
import threading
import time

import pytest

from shared.grammar_finite import longest_needed, never_ends
from shared.grammar_limits import MAX_GRAMMAR_CHARS, MAX_NEEDED_CHARS, check_grammar_cost
from shared.grammar_sandbox import GrammarSandbox, GrammarTimeout, WorkerDied
from shared.grammar_text import check_grammar

pytest.importorskip("llguidance")


@pytest.fixture
def sandbox():
    s = GrammarSandbox(workers=2)
    yield s
    s.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def slow_regex() -> str:
    """~250 KB of alternatives: about 1.5 s of checking on one core here, far past 0.05 s anywhere."""
    r = random.Random(1)
    return "(" + "|".join("".join(r.choice("abcdefghij") for _ in range(6)) for _ in range(36000)) + ")"


def test_a_run_answers_its_result_or_raises_its_error_and_the_worker_stays(sandbox):
    pid = sandbox.run(30, os.getpid)
    assert pid != os.getpid()
    with pytest.raises(ValueError, match="invalid literal"):
        sandbox.run(30, int, "x")
    assert sandbox.run(30, os.getpid) == pid  # an error of the work is not the worker's


def test_a_run_past_its_timeout_is_killed_and_the_next_one_runs():
    one = GrammarSandbox(workers=1)
    try:
        pid = one.run(30, os.getpid)
        t0 = time.monotonic()
        with pytest.raises(GrammarTimeout):
            one.run(0.5, time.sleep, 600)
        assert time.monotonic() - t0 < 30 and one.kills == 1
        assert not alive(pid)  # killed (and reaped) before the timeout was raised
        assert one.run(30, os.getpid) not in (pid, os.getpid())  # its replacement
    finally:
        one.close()


def test_a_dead_worker_fails_only_its_run(sandbox):
    with pytest.raises(WorkerDied, match="exit code 3"):
        sandbox.run(30, os._exit, 3)
    with pytest.raises(WorkerDied, match="SIGKILL"):
        sandbox.run(30, os.kill, 0, 9)  # its own process group: the worker only
    assert sandbox.run(30, sum, [1, 2]) == 3


def test_other_runs_go_on_while_one_is_stuck(sandbox):
    outcome: list[BaseException] = []

    def stuck() -> None:
        try:
            sandbox.run(10, time.sleep, 600)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=stuck)
    t.start()
    try:
        answers = [sandbox.run(30, sum, [i, 1]) for i in range(5)]
        assert answers == [1, 2, 3, 4, 5] and t.is_alive()  # answered while the other still ran
    finally:
        t.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], GrammarTimeout)


def test_a_worker_that_cannot_start_says_why():
    s = GrammarSandbox(init=importlib.import_module, init_args=("no_such_module_here",))
    try:
        with pytest.raises(WorkerDied, match="No module named 'no_such_module_here'"):
            s.run(30, os.getpid)
    finally:
        s.close()


def test_a_grammar_check_past_its_timeout_is_a_400_naming_the_field_and_the_next_check_runs():
    t0 = time.monotonic()
    with pytest.raises(
        ValueError, match=r"^sampling_params.regex took longer than 0.05 s to check; simplify it"
    ):
        check_grammar("regex", slow_regex(), timeout_s=0.05)
    assert time.monotonic() - t0 < 30
    assert check_grammar("regex", r"\d{3}-[a-z]+", timeout_s=30)
    with pytest.raises(ValueError, match="sampling_params.ebnf does not parse"):
        check_grammar("ebnf", 'root ::= "a', timeout_s=30)  # the check's own 400s come back as they were


@pytest.mark.parametrize(
    "kind, text",
    [
        ("regex", "a{1000000}"),
        ("regex", "(a{1000}){1000}"),
        ("regex", "x|(?:ab){60000}"),  # one alternative is enough
        ("ebnf", 'root ::= "a"{100001}'),
        ("ebnf", 'root ::= x "b"\nx ::= ("ab" | "c"){2000}{60}'),
        # a rule used twice, forty levels deep: 2^40 characters ("grammar explodes on expansion")
        (
            "ebnf",
            "root ::= r1 r1\n"
            + "\n".join(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(1, 40))
            + '\nr40 ::= "a"',
        ),
    ],
)
def test_a_part_that_needs_too_many_characters_is_a_400(kind, text):
    with pytest.raises(
        ValueError, match=rf"sampling_params.{kind}: a part of it needs .* at most {MAX_NEEDED_CHARS}"
    ):
        check_grammar_cost(kind, text)
    with pytest.raises(ValueError, match="a part of it needs"):
        check_grammar(kind, text, timeout_s=30)


def test_grammars_within_the_bounds_pass():
    for kind, text in [("regex", "a{100000}"), ("regex", "[a-z]{0,10000000}"),
                       ("regex", r"(\d{3}-){1,9}\d"), ("ebnf", 'root ::= ("a" "b"){50000}'),
                       ("ebnf", 'root ::= [a-z]* "." x{3,}\nx ::= "ab"'),
                       ("ebnf", 'root ::= "a" | "b" root')]:  # fmt: skip
        check_grammar_cost(kind, text)
    assert longest_needed('root ::= "ab\\n" x{3,}\nx ::= "yz" | [a-z]') == 6
    assert longest_needed('root ::= ("a" "b"){10} | "c"') == 20


def test_a_grammar_text_past_the_bound_is_a_400_before_any_worker():
    with pytest.raises(ValueError, match=f"sampling_params.ebnf: at most {MAX_GRAMMAR_CHARS} characters"):
        check_grammar("ebnf", 'root ::= "' + "a" * MAX_GRAMMAR_CHARS + '"')


def test_the_never_ending_rule_check_is_not_quadratic():
    """A root using 12,500 rules took the old check 75 s (each rule found productive sent the root
    back to be checked again); it settles each part once now."""
    n = 12_500
    ebnf = (
        "root ::= "
        + " ".join(f"r{i}" for i in range(n))
        + "\n"
        + "\n".join(f'r{i} ::= "a"' for i in range(n))
    )
    assert len(ebnf) < MAX_GRAMMAR_CHARS
    t0 = time.monotonic()
    assert never_ends("ebnf", ebnf) is None and longest_needed(ebnf) == n
    assert time.monotonic() - t0 < 30
    assert "never ends" in never_ends("ebnf", ebnf.replace('r7 ::= "a"', 'r7 ::= r7 "a"'))
