"""The language without a model: expressions, argument checks, the native request a gen becomes,
and the shared prefix that run_batch caches."""

from __future__ import annotations

import re

import pytest
from scripted_backend import ScriptedBackend

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
    with pytest.raises(ValueError, match="every choice must be a string"):
        sgl.select("x", choices=["a", 3])
    assert sgl.select("x", ["", " yes"]).choices == ["", " yes"]  # an empty choice appends nothing (SGLang)
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
        sgl.global_config.default_backend = None
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


def test_regex_patterns_are_sglangs_and_exported_where_sglang_has_them():
    from sglbus.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

    assert (REGEX_INT, REGEX_FLOAT, REGEX_BOOL, REGEX_STR) == (
        r"[-+]?[0-9]+[ \n]*", r"[-+]?[0-9]*\.?[0-9]+[ \n]*", r"(True|False)", r"\"[\w\d\s]*\"",
    )  # fmt: skip
    assert DTYPE_REGEX == {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}


def test_an_invalid_regex_is_re_error_as_in_sglang_and_still_a_value_error():
    for kwargs in ({"regex": "("}, {"stop_regex": ["ok", "[a-"]}):
        with pytest.raises(re.error, match="not a valid regular expression") as info:
            sgl.gen("x", **kwargs)
        assert isinstance(info.value, ValueError) and info.value.pos is not None


def test_gen_int_and_gen_string_take_sglangs_positional_order():
    # (name, max_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, ...)
    p = sgl.gen_int("x", 8, 2, "\n", [7], None, 0.5, 0.9, 5).params
    assert (p.max_new_tokens, p.n, p.stop, p.stop_token_ids, p.temperature, p.top_p, p.top_k, p.dtype) == (
        8, 2, "\n", [7], 0.5, 0.9, 5, "int",
    )  # fmt: skip
    q = sgl.gen_string("y", 8, 1, "\n", min_tokens=2).params
    assert (q.n, q.stop, q.min_new_tokens, q.dtype) == (1, "\n", 2, "str")
    with pytest.raises(TypeError, match="gen_string: 'json_schema' cannot be set here"):
        sgl.gen_string("y", json_schema={})
    with pytest.raises(TypeError, match="gen_int: unknown parameter 'max_token'.*did you mean 'max_tokens'"):
        sgl.gen_int("y", max_token=3)


def test_sglangs_api_module_names():
    import sglbus.lang.api as api
    from sglbus.engine import Engine

    assert (
        api.set_default_backend is sgl.set_default_backend
        and api.get_default_backend is sgl.get_default_backend
    )
    assert api.Runtime is sgl.Runtime and api.Engine is Engine and api.video is sgl.video
    assert api.global_config is sgl.global_config and sgl.lang.global_config is sgl.global_config
    assert set(api.__all__) <= {*dir(api), "Engine"}


def test_global_config_is_where_the_default_backend_lives():
    backend = ScriptedBackend()
    sgl.set_default_backend(backend)
    assert sgl.global_config.default_backend is backend and sgl.get_default_backend() is backend

    class Launched:  # what SGLang's Runtime is to set_default_backend: an object with an endpoint
        endpoint = ScriptedBackend()

    sgl.set_default_backend(Launched())
    assert sgl.global_config.default_backend is Launched.endpoint
    sgl.global_config.default_backend = backend  # assigned directly, as SGLang's programs may
    assert sgl.get_default_backend() is backend
    sgl.global_config.default_backend = None
    assert sgl.get_default_backend() is None


def test_flush_cache_and_server_info_without_a_backend_as_sglang():
    sgl.global_config.default_backend = None
    assert sgl.flush_cache() is False and sgl.flush_cache(empty_cache=False) is False
    assert sgl.get_server_info() is None
    backend = ScriptedBackend()
    sgl.set_default_backend(backend)
    try:
        assert sgl.flush_cache(empty_cache=False) is True and backend.flushed == [False]
        assert sgl.flush_cache(backend) is True and backend.flushed == [False, True]
        assert sgl.get_server_info() == {"model_path": "scripted"}
    finally:
        sgl.global_config.default_backend = None


def test_native_requests_follow_the_global_detokenizer_options():
    assert generate_request("x", SamplingParams())["sampling_params"]["skip_special_tokens"] is True
    sgl.global_config.skip_special_tokens_in_output = False
    try:
        assert generate_request("x", SamplingParams())["sampling_params"]["skip_special_tokens"] is False
    finally:
        sgl.global_config.skip_special_tokens_in_output = True


def test_sglang_module_paths_resolve_with_the_package_name_changed():
    """Imports written for SGLang's frontend modules, with `sglang` changed to `sglbus`."""
    from sglbus.lang.backend.base_backend import BaseBackend
    from sglbus.lang.backend.openai import OpenAI
    from sglbus.lang.backend.runtime_endpoint import RuntimeEndpoint
    from sglbus.lang.interpreter import ProgramState
    from sglbus.lang.ir import SglFunction

    assert (ProgramState, SglFunction, RuntimeEndpoint, OpenAI) == (
        sgl.ProgramState, sgl.Function, sgl.RuntimeEndpoint, sgl.OpenAI)  # fmt: skip
    assert issubclass(RuntimeEndpoint, BaseBackend)
    with pytest.raises(ImportError):
        from sglbus.lang.ir import NoSuchThing  # noqa: F401
