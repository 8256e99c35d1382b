"""The language without a model: expressions, argument checks, the native request a gen becomes,
and the shared prefix that run_batch caches."""

from __future__ import annotations

import pytest

import sglbus as sgl
from sglbus.lang import ir
from sglbus.lang.backends.native import generate_request
from sglbus.lang.params import DTYPE_REGEX, SamplingParams, run_defaults


def test_expressions_flatten_in_order():
    e = "Q: " + sgl.gen("a", max_tokens=4) + "\n" + sgl.select("b", choices=["x", "y"])
    kinds = [type(x).__name__ for x in e.items]
    assert kinds == ["Text", "Gen", "Text", "Select"]
    assert e.items[1].params.max_new_tokens == 4
    role = sgl.user("hi" + sgl.gen("r"))
    assert [type(x).__name__ for x in role.items] == ["RoleBegin", "Text", "Gen", "RoleEnd"]
    assert isinstance(sgl.assistant_begin(), ir.RoleBegin) and sgl.assistant_end().role == "assistant"
    with pytest.raises(TypeError, match="strings and sgl expressions.*got int"):
        sgl.gen("a") + 3


def test_gen_with_choices_is_select():
    s = sgl.gen("c", choices=[" a", " b"], choices_method=sgl.greedy_token_selection)
    assert isinstance(s, ir.Select) and s.method is sgl.greedy_token_selection and s.choices == [" a", " b"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"max_token": 5},
            r"gen: unknown parameter 'max_token' \(parameters: name, max_tokens.*did you mean 'max_tokens'",
        ),
        ({"temperature": -1}, "gen: temperature must be a number >= 0"),
        ({"top_p": 0}, r"gen: top_p must be a number in \(0, 1\]"),
        ({"top_k": 0}, "gen: top_k must be -1 .no limit. or an integer >= 1"),
        ({"max_tokens": 2.5}, "gen: max_new_tokens must be an integer >= 0"),
        ({"stop": 3}, "gen: stop must be a string or a list of strings"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of token ids"),
        ({"regex": "(unclosed"}, "gen: regex is not a valid regular expression"),
        ({"json_schema": "{nope"}, "gen: json_schema is not valid JSON"),
        ({"dtype": list}, "gen: dtype must be one of int, float, bool, str"),
        ({"regex": "a", "json_schema": "{}"}, "give regex or json_schema, not both"),
        ({"frequency_penalty": 3}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"choices_method": sgl.greedy_token_selection}, "choices_method needs choices"),
    ],
)
def test_gen_argument_errors(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        sgl.gen("x", **kwargs)


def test_select_argument_errors():
    with pytest.raises(ValueError, match="choices must be a non-empty list"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match="every choice must be a non-empty string"):
        sgl.select("x", choices=["a", ""])
    with pytest.raises(ValueError, match="temperature must be 0"):
        sgl.select("x", choices=["a"], temperature=0.5)
    with pytest.raises(ValueError, match="choices_method must be sgl.token_length_normalized, sgl.greedy"):
        sgl.select("x", choices=["a"], choices_method="greedy")
    with pytest.raises(TypeError, match="gen_int: 'regex' cannot be set here"):
        sgl.gen_int("n", regex="[0-9]")


def test_gen_overrides_run_defaults_and_becomes_a_native_request():
    defaults = run_defaults(max_new_tokens=128, temperature=1.0, stop=[], stop_regex=[], top_k=-1)
    params = sgl.gen("n", max_tokens=8, temperature=0, stop="\n", dtype=int).params.over(defaults)
    assert params.max_new_tokens == 8 and params.temperature == 0 and params.top_k == -1
    body = generate_request("The number: ", params)
    assert body["text"] == "The number: "
    sp = body["sampling_params"]
    assert sp["regex"] == DTYPE_REGEX["int"] and sp["stop"] == ["\n", " "]  # numbers also end at a space
    assert sp["max_new_tokens"] == 8 and sp["temperature"] == 0 and "stop_regex" not in sp
    logprobs = generate_request("x", SamplingParams(return_logprob=True, top_logprobs_num=2), stream=True)
    assert logprobs["return_logprob"] is True and logprobs["top_logprobs_num"] == 2 and logprobs["stream"]
    assert sgl.gen("j", json_schema={"type": "object"}).params.json_schema == '{"type": "object"}'


def test_function_checks():
    with pytest.raises(TypeError, match="the first parameter must be the state"):
        sgl.function(lambda: None)

    @sgl.function
    def f(s, a, b=1):
        s += a

    assert f.arg_names == ["a", "b"]
    with pytest.raises(TypeError, match="f.bind: no parameter 'c'"):
        f.bind(c=1)
    assert f.bind(b=2).bind_arguments == {"b": 2}
    with pytest.raises(ValueError, match="no backend: pass backend=... or call sgl.set_default_backend"):
        sgl.lang.backends.base._default[0] = None
        f.run(a="x")
    with pytest.raises(TypeError, match="a backend must be sgl.RuntimeEndpoint"):
        f.run(a="x", backend="http://localhost:30000")


def test_import_sglbus_stays_cheap():
    import subprocess
    import sys

    code = "import sys, sglbus as sgl; sgl.function; sgl.RuntimeEndpoint; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_lazy_names_of_sglbus_are_the_names_of_sglbus_lang():
    """`import sglbus as sgl` loads the language lazily from a list of its own (static, for linters):
    it must stay the language's __all__."""
    import sglbus
    import sglbus.lang

    assert list(sglbus._LANG) == list(sglbus.lang.__all__)
    assert all(getattr(sglbus, name) is getattr(sglbus.lang, name) for name in sglbus._LANG)
