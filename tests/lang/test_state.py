"""ProgramState and Function the way SGLang's programs use them, on a scripted backend (no model): the
role methods' return value, str(state), copy(), global_config's verbosity and pre-caching."""

from __future__ import annotations

import pytest
from scripted_backend import ScriptedBackend

import sglbus as sgl


def test_role_methods_append_the_role_and_return_it_for_plus_equals():
    """SGLang's tutorial: `s += s.system(x)` is the same as `s += sgl.system(x)`."""

    @sgl.function
    def chat(s):
        s += s.system("Be brief.")
        s.user("Hi")  # a statement of its own appends too, as in SGLang
        role = s.assistant("Hello")
        return role

    state = chat.run(backend=ScriptedBackend())
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.text() == "SYSTEM:Be brief.\nUSER:Hi\nASSISTANT:Hello\n"
    assert [type(x).__name__ for x in state.ret_value.items] == ["RoleBegin", "Text", "RoleEnd"]

    @sgl.function
    def reuse(s, role):
        s += role  # appended to another state: a role like any other

    assert reuse.run(role=state.ret_value, backend=ScriptedBackend()).text() == "ASSISTANT:Hello\n"


def test_str_and_repr_are_sglangs_format():
    @sgl.function
    def f(s):
        s += "it's a\ntest"

    state = f.run(backend=ScriptedBackend())
    assert str(state) == repr(state) == "ProgramState(it's a\ntest)"
    assert str(state)[len("ProgramState(") : -1] == state.text()  # how SGLang's cot_decoding reads it


def test_copy_takes_position_ids_offset_like_fork():
    @sgl.function
    def f(s, offset):
        s += "x"
        with s.copy(offset) as c:
            c += "y" + sgl.gen("z", max_tokens=1)

    assert f.run(offset=None, backend=ScriptedBackend("xyz")).text() == "x"
    with pytest.raises(ValueError, match="position_ids_offset is not supported"):
        f.run(offset=[0], backend=ScriptedBackend())


def test_verbosity_2_prints_the_text_of_each_run(capsys):
    @sgl.function
    def f(s):
        s += "Q:" + sgl.gen("a", stop="\n")

    backend = ScriptedBackend("Q: yes\n")
    f.run(backend=backend)
    assert capsys.readouterr().out == ""
    sgl.global_config.verbosity = 2
    try:
        f.run(backend=backend)
        assert capsys.readouterr().out == "Q: yes\n"
    finally:
        sgl.global_config.verbosity = 0


def test_run_batch_precaches_the_shared_prefix_unless_told_not_to():
    few_shot = "Answer with one word. " * 4

    @sgl.function
    def qa(s, question):
        s += few_shot
        s += question + sgl.gen("a", max_tokens=2)

    batch = [{"question": "A?"}, {"question": "B?"}]
    backend = ScriptedBackend()
    qa.run_batch(batch, backend=backend)
    assert [b["sampling_params"]["max_new_tokens"] for b in backend.bodies].count(0) == 1  # the prefix
    assert backend.bodies[0]["text"] == few_shot
    sgl.global_config.enable_precache_with_tracing = False
    try:
        backend.bodies = []
        qa.run_batch(batch, backend=backend)
        assert all(b["sampling_params"]["max_new_tokens"] == 2 for b in backend.bodies)
    finally:
        sgl.global_config.enable_precache_with_tracing = True


def test_a_program_called_before_the_first_argument_ends_the_cached_prefix():
    """run_batch traces the shared prefix; a program called there is not run (it would call the model)."""
    calls = []

    @sgl.function
    def sub(s):
        calls.append("sub")
        s += "x"

    @sgl.function
    def main(s, q):
        s += "A shared instruction that is long enough to be worth caching on its own. "
        sub()
        s += q

    assert main.cache(ScriptedBackend()).startswith("A shared instruction") and calls == []
