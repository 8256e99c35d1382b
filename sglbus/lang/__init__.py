"""The frontend language: LM programs as Python functions over a prompt state.

    import sglbus as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://localhost:30000"))  # or sgl.Engine(), sgl.OpenAI, ...
    print(qa.run(question="Why is the sky blue?")["answer"])

Programs written for SGLang's frontend (`import sglang as sgl`) run with only the import changed.
"""

from sglbus.lang.api import (
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from sglbus.lang.backends.base import Backend, get_default_backend, set_default_backend
from sglbus.lang.backends.bus import BusEndpoint
from sglbus.lang.backends.engine import EngineBackend
from sglbus.lang.backends.openai import OpenAI
from sglbus.lang.backends.runtime_endpoint import RuntimeEndpoint
from sglbus.lang.chat import ChatTemplate
from sglbus.lang.chat_template import get_chat_template
from sglbus.lang.choices import (
    ChoiceDecision,
    ChoiceMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from sglbus.lang.function import Function
from sglbus.lang.global_config import GlobalConfig, global_config
from sglbus.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend", "BusEndpoint", "ChatTemplate", "ChoiceDecision", "ChoiceMethod", "EngineBackend", "ForkGroup",
    "Function", "GlobalConfig", "OpenAI", "ProgramState", "Runtime", "RuntimeEndpoint", "assistant",
    "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_chat_template", "get_default_backend", "get_server_info", "global_config", "greedy_token_selection",
    "image", "select", "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
    "video",
]  # fmt: skip
