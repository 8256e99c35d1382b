"""Compiler mode: the graph a traced program becomes (without a model), programs it refuses, and
compiled runs on the in-process Engine compared with interpreter mode (greedy), with the number of
backend requests the graph scheduler sends."""

from __future__ import annotations

from typing import Any

import pytest
from scripted_backend import ScriptedBackend

import sglbus as sgl
from sglbus.lang.backends.engine import EngineBackend
from sglbus.lang.params import SamplingParams
from sglbus.lang.tracer import Node, UntraceableError


@sgl.function
def judge(s, essay):
    """Branch-solve-merge: two aspects judged in parallel, then merged into one grade."""
    s += sgl.user("Essay: " + essay + "\n")
    s += sgl.assistant_begin()
    forks = s.fork(2)
    for f, aspect in zip(forks, ["clarity", "style"], strict=True):
        f += f"Judge the {aspect} in one line:" + sgl.gen("judgment", max_tokens=6, stop="\n")
    s += "Clarity: " + forks[0]["judgment"] + "\nStyle: " + forks[1]["judgment"] + "\n"
    forks.join()
    s += "Grade: " + sgl.select("grade", choices=["A", "B", "C"])
    s += sgl.assistant_end()
    return s["grade"]


def ancestors(node: Node) -> set[int]:
    seen: set[int] = set()
    todo = list(node.deps)
    while todo:
        d = todo.pop()
        if d.id not in seen:
            seen.add(d.id)
            todo += d.deps
    return seen


def test_trace_is_a_graph_of_streams():
    t = judge.trace()
    assert t.placeholders == ["essay"]
    main = [n.kind for n in t.streams[0]]
    assert main == ["role_begin", "text", "argument", "text", "role_end", "role_begin", "fork", "text",
                    "variable", "text", "variable", "text", "join", "text", "select", "role_end"]  # fmt: skip
    fork = t.streams[0][6]
    assert fork.step.branches == [1, 2] and set(t.streams) == {0, 1, 2}
    gens = []
    for branch, aspect in zip(fork.step.branches, ["clarity", "style"], strict=True):
        text, gen = t.streams[branch]
        assert text.step.value == f"Judge the {aspect} in one line:" and text.deps == [fork]
        assert gen.kind == "gen" and gen.deps == [text] and gen.step.params.max_new_tokens == 6
        gens.append(gen)
    # the two gens are independent: the scheduler can send them together; the select needs both
    assert gens[0].id not in ancestors(gens[1]) and gens[1].id not in ancestors(gens[0])
    first_value, join, select = t.streams[0][8], t.streams[0][12], t.streams[0][14]
    assert gens[0] in first_value.deps and first_value.step.name == "judgment"
    assert join.deps == [t.streams[0][11], *gens] and join.produces == ["judgment"]  # a list in s0
    assert {g.id for g in gens} <= ancestors(select)
    assert [n.id for n in t.model_calls()] == [gens[0].id, gens[1].id, select.id]
    assert t.ret_value.node is select  # `return s["grade"]`: resolved when the graph runs
    listing = str(t)
    assert listing.startswith("trace of judge: 20 nodes, 3 streams, 3 model calls; placeholders: essay")
    assert f"%{fork.id:<3} s0  fork            2 -> s1, s2 <- %{fork.deps[0].id}" in listing

    bound = judge.trace(essay="Short and sweet.")  # a bound argument is constant text, merged
    assert bound.placeholders == [] and bound.streams[0][1].step.value == "Essay: Short and sweet.\n"


def test_join_gathers_branch_variables_into_the_parent():
    @sgl.function
    def votes(s):
        s += "Vote:"
        forks = s.fork(3)
        forks += sgl.gen("v", max_tokens=2)
        forks.join()
        return s["v"]

    t = votes.trace()
    join = t.streams[0][-1]
    assert join.kind == "join" and join.produces == ["v"] and t.ret_value.node is join
    assert len(join.deps) == 4 and [d.kind for d in join.deps[1:]] == ["gen"] * 3


def test_untraceable_programs_are_refused_clearly():
    @sgl.function
    def branchy(s):
        s += "Is the sky blue?" + sgl.select("yes", choices=["yes", "no"])
        if s["yes"] == "yes":
            s += "Why?" + sgl.gen("why")

    refused = r"cannot trace branchy: the generated value of 'yes' is used by the program's Python code"
    with pytest.raises(
        UntraceableError, match=refused + r" \(compared with ==\).*interpreter mode \(fn.run\)"
    ):
        branchy.compile()

    @sgl.function
    def formatted(s, q):
        s += f"Q: {q}\nA:" + sgl.gen("a", max_tokens=4)

    with pytest.raises(
        UntraceableError, match=r"argument 'q' is used .*\(str\(\) or an f-string\).*compile\(q="
    ):
        formatted.compile()
    assert formatted.compile(q="Why?").trace.streams[0][0].step.value == "Q: Why?\nA:"

    @sgl.function
    def reads_text(s):
        s += "x" + sgl.gen("a", max_tokens=1)
        return len(s.text())

    with pytest.raises(UntraceableError, match=r"s.text\(\) reads what the model generates"):
        reads_text.trace()
    with pytest.raises(ValueError, match="API speculative execution .* interpreter mode"):
        sgl.function(num_api_spec_tokens=64)(reads_text.func).compile()


def test_sglangs_tracing_interface():
    @sgl.function
    def wrong(s, question):
        s += f"I want to ask {question}"

    with pytest.raises(TypeError, match="f-string"):  # SGLang's test_tracing.test_raise_warning
        wrong.trace()

    @sgl.function
    def qa(s, backend_hint, question):
        s += s.system("Answer briefly.")  # appended once: s.system(x) appended it already
        s += backend_hint + "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n")

    t = qa.trace(backend=ScriptedBackend(), backend_hint="")  # backend: keyword only, not an argument
    assert t.placeholders == ["question"]
    assert [n.kind for n in t.streams[0][:3]] == ["role_begin", "text", "role_end"]
    assert t.last_node is t.streams[0][-1] and t.last_node.kind == "gen"
    listing = t.last_node.print_graph_dfs()  # every node the last one depends on, dependencies first
    assert listing.splitlines() == [str(n) for n in t.nodes] and listing.endswith("\n")


def test_a_program_called_inside_a_compiled_one_is_part_of_its_graph(capsys):
    """SGLang's test_tracing.test_multi_function: each call is a stream of its own, fed by the caller."""

    @sgl.function
    def expand(s, tip):
        s += "Expand:" + tip + "\n" + sgl.gen("detailed_tip", stop="\n")

    @sgl.function
    def tips(s, topic):
        s += "Tips for " + topic + ".\n1." + sgl.gen("tip_1", stop="\n")
        s += "\n2." + sgl.gen("tip_2", stop="\n")
        first, second = expand(tip=s["tip_1"]), expand(s["tip_2"])
        s += "\nTip 1:" + first["detailed_tip"] + "\nTip 2:" + second["detailed_tip"] + "\nIn short:"
        s += sgl.gen("summary", stop="\n")

    compiled = tips.compile()
    t = compiled.trace
    assert set(t.streams) == {0, 1, 2} and t.stream_start[1] is None and t.stream_start[2] is None
    tip_1 = next(n for n in t.streams[0] if n.kind == "gen" and n.step.name == "tip_1")
    assert tip_1 in t.streams[1][1].deps  # the sub-program's `tip` is the caller's tip_1
    compiled.print_graph()
    assert capsys.readouterr().out == str(t) + "\n"

    main = "Tips for sleep.\n1. dark room\n2. no screens\nTip 1: keep it dark\nTip 2: read it\nIn short: ok\n"
    subs = ["Expand: dark room\n keep it dark\n", "Expand: no screens\n read it\n"]
    backend = ScriptedBackend(main, *subs)
    sgl.set_default_backend(backend)  # interpreter mode runs the called program on the default backend
    try:
        interpreted = tips.run(topic="sleep")
        assert interpreted.error() is None and interpreted["summary"] == " ok"
        state = compiled.run(topic="sleep", backend=backend)
        assert state.error() is None and state.text() == interpreted.text() == main[:-1]
    finally:
        sgl.global_config.default_backend = None

    @sgl.function
    def calls_with_defaults(s):
        s += expand(tip="x", temperature=0)["detailed_tip"]

    with pytest.raises(
        UntraceableError, match=r"expand\(temperature=...\): a program called inside a traced"
    ):
        calls_with_defaults.compile()


def test_compiled_arguments_are_checked_before_any_call():
    @sgl.function
    def qa(s, question, style="briefly"):
        s += "Answer " + style + ": " + question + sgl.gen("a", max_tokens=4)

    compiled = qa.compile(style="in French")
    assert compiled.trace.placeholders == ["question"]
    with pytest.raises(TypeError, match="missing argument 'question'"):
        compiled.run()
    with pytest.raises(TypeError, match="'style' was bound when compiling"):
        compiled.run(question="Why?", style="no")
    with pytest.raises(TypeError, match="argument 'question' must be a string .* got int"):
        compiled.run_batch([{"question": "Why?"}, {"question": 3}])
    with pytest.raises(TypeError, match="run_batch: unknown argument 'max_tokens'"):
        compiled.run_batch([("Why?",)], max_tokens=3)


class CountingBackend(EngineBackend):
    """The Engine backend, counting the /generate requests it sends to the engine."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.bodies: list[dict[str, Any]] = []

    def _request(self, body: dict[str, Any]) -> Any:
        self.bodies.append(body)
        return super()._request(body)


@pytest.mark.slow
def test_compiled_fork_and_merge_equals_interpreter(backend):
    essay = "The sea is big. It is blue. I like it."
    interpreted = judge.run(essay=essay, temperature=0)
    compiled = judge.compile().run(essay=essay, temperature=0)
    assert interpreted.error() is None and compiled.error() is None, (interpreted.error(), compiled.error())
    assert compiled.text() == interpreted.text()
    assert compiled.messages() == interpreted.messages()
    assert compiled["judgment"] == interpreted["judgment"] and len(compiled["judgment"]) == 2
    assert compiled.ret_value == compiled["grade"] == interpreted["grade"]
    ours, theirs = compiled.get_meta_info("grade"), interpreted.get_meta_info("grade")
    assert ours["normalized_prompt_logprobs"] == pytest.approx(theirs["normalized_prompt_logprobs"], abs=1e-4)


@pytest.mark.slow
def test_compiled_run_batch_batches_the_ready_gens(backend, engine):
    @sgl.function
    def qa(s, question):
        s += "Answer in a few words.\nQ: " + question + "\n"
        forks = s.fork(2)
        forks += lambda i: f"Answer {i + 1}:" + sgl.gen("a", max_tokens=5, stop="\n")
        forks.join("concate_and_append")
        s += "\nIn short:" + sgl.gen("short", max_tokens=4, n=2)

    questions = [{"question": q} for q in ["Where is Paris?", "What is 2+2?", "Who wrote Hamlet?"]]
    counting = CountingBackend(engine)
    interpreted = qa.run_batch(questions, temperature=0, backend=counting)
    interpreted_requests, counting.bodies = len(counting.bodies), []
    compiled = qa.compile()
    states = compiled.run_batch(questions, temperature=0, backend=counting, progress_bar=True)
    assert [s.error() for s in states] == [None] * 3
    assert [s.text() for s in states] == [s.text() for s in interpreted]
    assert [s["short"] for s in states] == [s["short"] for s in interpreted]
    assert all(len(s["short"]) == 2 for s in states)  # n=2: both samples, through the batch
    # one request for the six branch gens of all runs, one for the three n=2 gens after the joins
    assert [len(b["text"]) for b in counting.bodies] == [6, 3]
    assert len(counting.bodies) < len(compiled.trace.nodes) * len(questions)
    assert len(counting.bodies) < interpreted_requests


@pytest.mark.slow
def test_generate_batch_sends_one_request_and_isolates_a_bad_gen(backend, engine):
    counting = CountingBackend(engine)
    prompts = ["The capital of France is", "1, 2, 3,", "Hello"]
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    out = counting.generate_batch(prompts[:2], [greedy, greedy])
    assert len(counting.bodies) == 1 and counting.bodies[0]["text"] == prompts[:2]
    assert [text for text, _ in out] == [counting.generate(p, greedy)[0] for p in prompts[:2]]
    too_long = SamplingParams(max_new_tokens=10**7, temperature=0)
    out = counting.generate_batch(prompts, [greedy, greedy, too_long])
    assert [type(r) for r in out[:2]] == [tuple, tuple] and isinstance(out[2], Exception)
    assert "max_new_tokens" in str(out[2])
