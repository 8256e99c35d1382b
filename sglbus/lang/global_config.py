"""`sgl.global_config`: the language's process-wide settings, as SGLang's frontend has them.

    sgl.global_config.verbosity = 2  # print each program's text when its run ends
    sgl.global_config.default_backend  # what sgl.set_default_backend set

One object, read where each setting is used, so a change applies to the next run.
"""

from __future__ import annotations

from typing import Any


class GlobalConfig:
    def __init__(self) -> None:
        # 0: print nothing; 2: print the text of every program run (interpreter mode) when it ends
        self.verbosity = 0
        # the backend run() uses when given none; set_default_backend stores the Backend it resolved
        # (an Engine or a Runtime as the backend it wraps); anything resolvable may be assigned here
        self.default_backend: Any = None
        # the detokenizer options of every native gen request (RuntimeEndpoint, Engine, BusEndpoint)
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        # run_batch sends the prefix all its runs share to the runtime's cache before them
        self.enable_precache_with_tracing = True

    def __repr__(self) -> str:
        return f"GlobalConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


global_config = GlobalConfig()
