"""Programs through the interpreter on the in-process Engine (default model, CPU, greedy): the
tutorial's programs, roles through the model's chat template, forks, streaming, run_batch, and the
errors a program gets."""

from __future__ import annotations

import asyncio
import threading

import pytest

import sglbus as sgl

pytestmark = pytest.mark.slow
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOLS = {"weather": lambda q: "22 degrees and sunny", "calculator": lambda q: "10"}


@sgl.function
def react(s, question):
    s += sgl.system("You are a tool-using assistant. Use the format:\nThought: ...\nAction: <tool>\n")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    for step in range(2):
        s += "Thought: " + sgl.gen(f"thought_{step}", max_tokens=12, stop="\n")
        s += "\nAction: " + sgl.select(f"action_{step}", choices=[*TOOLS, "FINISH"])
        if s[f"action_{step}"] == "FINISH":
            break
        s += f"\nObservation: {TOOLS[s[f'action_{step}']]('')}\n"
    s += "\nFinal Answer: " + sgl.gen("final", max_tokens=8)
    s += sgl.assistant_end()


def test_react_with_select_over_tools(backend):
    state = react.run(question="What is 2+3+5?", temperature=0)
    assert state.error() is None, state.error()
    text = state.text()
    assert text.startswith("<|im_start|>system\nYou are a tool-using assistant.")
    assert state["action_0"] in [*TOOLS, "FINISH"]
    assert "Action: " + state["action_0"] in text and text.endswith(state["final"] + "<|im_end|>\n")
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[2]["content"].startswith("Thought: " + state["thought_0"].lstrip())
    # greedy: the same program gives the same text (the second run reuses the prefix cache)
    assert react.run(question="What is 2+3+5?", temperature=0).text() == text


def test_multi_turn_roles_use_the_model_template(backend):
    @sgl.function
    def chat(s, turns):
        for q in turns:
            s += sgl.user(q)
            s += sgl.assistant(sgl.gen("reply", max_tokens=6, temperature=0))

    state = chat.run(turns=["Hi!", "What is your name?"])
    msgs = state.messages()
    # no system message in the program: the model's template puts its default one first
    assert msgs[0] == {"role": "system", "content": SYSTEM}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert state.text() == backend.get_chat_template().render(msgs)
    assert state.text() == backend.engine.tokenizer.apply_chat_template(msgs, tokenize=False)
    assert msgs[4]["content"] == state["reply"].lstrip()  # the last gen of a name wins


def test_fork_and_vote(backend, engine):
    @sgl.function
    def vote(s, question):
        s += sgl.system("Think step by step.")
        s += sgl.user(question)
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += sgl.assistant_begin()
            f += f"Attempt {i}: " + sgl.gen("reasoning", max_tokens=6, stop="\n")
            f += sgl.assistant_end()
        answers = [forks[i]["reasoning"] for i in range(3)]
        s += "Final answer: " + sgl.gen("final", choices=answers)
        forks.join()

    before = engine.get_stats()["cached_tokens"]
    state = vote.run(question="What is 7 times 6?", temperature=0)
    assert state.error() is None, state.error()
    assert len(state["reasoning"]) == 3  # join gathers each branch's variable
    assert state["final"] in state["reasoning"]
    assert state.text().endswith("Final answer: " + state["final"])
    # the prefix hint before the fork: the three branches read the shared prompt from the cache
    assert engine.get_stats()["cached_tokens"] - before >= 3 * len(
        engine.tokenizer.encode("Think step by step.")
    )


def test_zero_token_gen_reads_the_next_token_top_logprobs(backend, engine):
    """SGLang's cot_decoding example, short: `gen(max_tokens=0, return_logprob=True, top_logprobs_num=k)`
    reads the k likely next tokens as `get_meta_info(name)["output_top_logprobs"][0]`, and each fork
    goes on from one of them."""

    @sgl.function
    def top_k_paths(s, question, k):
        s += "Question: " + question + "\nAnswer:"
        step_0 = s.fork(1)[0]
        forks = s.fork(k)
        step_0 += sgl.gen("get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=k,
                          return_text_in_logprobs=True)  # fmt: skip
        top = step_0.get_meta_info("get_top_k")["output_top_logprobs"][0]
        for f, (_logprob, _token_id, text) in zip(forks, top, strict=True):
            f += text + sgl.gen("answer", max_tokens=3, temperature=0)
        return step_0, top, [f["answer"] for f in forks]

    state = top_k_paths.run(question="What is the capital of France?", k=3)
    assert state.error() is None, state.error()
    step_0, top, answers = state.ret_value
    meta = step_0.get_meta_info("get_top_k")
    assert step_0["get_top_k"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert len(top) == 3 and [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
    assert all(isinstance(text, str) for _, _, text in top) and len(answers) == 3
    greedy = engine.generate("Question: What is the capital of France?\nAnswer:",
                             {"max_new_tokens": 1, "temperature": 0})  # fmt: skip
    assert top[0][1] == greedy["output_ids"][0]


def test_forks_run_concurrently(backend):
    seen: list[str] = []

    @sgl.function
    def branches(s):
        s += "List:"
        forks = s.fork(2)
        forks += lambda i: f" item {i}" + sgl.gen("x", max_tokens=4, temperature=0)
        seen.append(threading.current_thread().name)  # the program went on before any result
        forks.join("concate_and_append")

    state = branches.run()
    assert state.error() is None, state.error()
    assert "x" not in state  # concate_and_append appends the branches' text, not their variables
    one = branches.run().text()
    assert state.text() == one  # greedy
    i0, i1 = one.index(" item 0"), one.index(" item 1")
    assert one.startswith("List: item 0") and i0 < i1
    assert seen == [threading.current_thread().name] * 2


def test_gen_int_regex_and_n(backend):
    @sgl.function
    def typed(s):
        s += "The number after 41 is " + sgl.gen_int("n", max_tokens=4)
        s += "\nA hex byte: 0x" + sgl.gen("hex", max_tokens=4, regex=r"[0-9a-f]{2}")
        s += "\nA word:" + sgl.gen("w", max_tokens=3, n=2, temperature=0)

    state = typed.run(temperature=0)
    assert state.error() is None, state.error()
    int(state["n"])
    assert len(state["hex"]) == 2 and int(state["hex"], 16) >= 0
    assert isinstance(state["w"], list) and len(state["w"]) == 2 and state["w"][0] == state["w"][1]
    assert state.text().endswith("A word:" + state["w"][0])


def test_separate_reasoning_on_the_model(backend):
    """A regex makes the model think in <think> tags; each of n samples is split as the parser splits
    its raw text."""
    from shared.reasoning_parser import ReasoningParser

    think = r"<think>[a-z ]{1,12}</think>[A-Z][a-z]{1,6}"

    @sgl.function
    def thinker(s, split):
        gen = sgl.gen("a", n=2, max_tokens=40, temperature=0, regex=think)
        s += "Think, then name a city:" + (sgl.separate_reasoning(gen, model_type="qwen3") if split else gen)

    raw, state = thinker.run(split=False), thinker.run(split=True)
    assert raw.error() is None and state.error() is None
    want = [ReasoningParser("qwen3").parse_non_stream(t) for t in raw["a"]]
    assert state["a_reasoning_content"] == [r for r, _ in want] and all(r for r, _ in want)
    assert state["a"] == [a for _, a in want] and state.text().endswith(want[0][1])


def test_stream_text_iter_sync_and_async(backend):
    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=10, stop="\n", temperature=0)

    plain = qa.run(question="What is the capital of France?")
    streamed = qa.run(question="What is the capital of France?", stream=True)
    pieces = list(streamed.text_iter())
    assert len(pieces) > 2 and "".join(pieces) == streamed.text() == plain.text()

    async def follow() -> list[tuple[str, dict]]:
        state = qa.run(question="What is the capital of France?", stream=True)
        return [p async for p in state.text_async_iter("answer", return_meta_data=True)]

    got = asyncio.run(follow())
    assert "".join(p for p, _ in got) == plain["answer"]
    assert got[-1][1]["completion_tokens"] >= 1


def test_run_batch_caches_the_shared_prefix(backend, engine):
    @sgl.function
    def qa(s, question):
        s += "You answer questions about geography in one short sentence, without any preamble.\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, stop="\n", temperature=0)

    assert qa.shared_prefix(backend).startswith("You answer questions") and "Q:" not in qa.shared_prefix(
        backend
    )
    engine.flush_cache()
    questions = ["Where is Paris?", "Where is Rome?", "Where is Oslo?"]
    states = qa.run_batch([{"question": q} for q in questions], progress_bar=True, num_threads=2)
    assert [q in s.text() for q, s in zip(questions, states, strict=True)] == [True] * 3
    assert all(s.get_meta_info("answer")["cached_tokens"] > 0 for s in states)
    assert [s["answer"] for s in states] == [qa.run(question=q)["answer"] for q in questions]
    assert [s["answer"] for s in qa.run_batch([(q,) for q in questions], generator_style=True)] == [
        s["answer"] for s in states
    ]


def test_program_errors_are_clear(backend):
    @sgl.function
    def with_image(s):
        s += sgl.user(sgl.image("cat.png") + "What is this?")
        s += sgl.assistant(sgl.gen("a", max_tokens=4))

    state = with_image.run()
    assert isinstance(state.error(), ValueError)
    assert "image: the model" in str(state.error()) and "text-only" in str(state.error())
    with pytest.raises(RuntimeError, match="variable 'a' was not produced: the program failed: image"):
        state["a"]

    @sgl.function
    def nested(s):
        s += sgl.user_begin() + sgl.assistant_begin()

    assert "roles do not nest" in str(nested.run().error())

    @sgl.function
    def missing(s):
        s += "x" + sgl.gen("a", max_tokens=1)
        return s["b"]

    with pytest.raises(KeyError, match="no variable 'b' in this state .variables: 'a'"):
        missing.run()
    with pytest.raises(ValueError, match="run: temperature must be a number >= 0"):
        missing.run(temperature=-1)

    @sgl.function
    def too_long(s):
        s += "x" + sgl.gen("a", max_tokens=10**7)

    assert too_long.run().error() is not None  # refused by the runtime, reported on the state


def test_api_speculation_on_the_engine(backend):
    """As SGLang's completion-style speculation on a native backend: one wide call, the gens cut from it."""

    @sgl.function(num_api_spec_tokens=24)
    def character(s):
        s += "Name: Marie Curie\nJob: chemist\n\nName: Alan Turing\nJob:" + sgl.gen("job", stop="\n")
        s += "\n\nName:" + sgl.gen("name", stop="\n")

    state = character.run(temperature=0, max_new_tokens=16)
    assert state.error() is None, state.error()
    assert state.get_meta_info("job")["api_speculative"] == "call" and state["job"].strip()
    assert state.text().endswith("\n\nName:" + state["name"])
