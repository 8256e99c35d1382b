"""`sgl.RuntimeEndpoint(url)`: programs against a running server's native API (`sglbus serve`, or
any server with SGLang's `/generate`).

Standard library HTTP only, so the frontend needs nothing beyond `import sglbus`.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from sglbus.lang.backends.native import NativeBackend
from sglbus.lang.chat import ChatTemplate, template_from_folder
from sglbus.lang.chat_template import get_chat_template, template_for_model

TIMEOUT_S = 600.0


class RuntimeEndpoint(NativeBackend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: str | bool | None = None,
                 chat_template_name: str | None = None) -> None:  # fmt: skip
        """chat_template_name: a named template (sglbus.lang.chat_template: `chatml`, `llama-3-instruct`,
        `llama-2-chat`, ...); without it the model's own template when its tokenizer folder is readable
        here, else one picked by the model's name."""
        self.base_url = base_url.rstrip("/")
        self.api_key, self.verify = api_key, verify
        self.model_info = self._json("GET", "/get_model_info")
        if chat_template_name is not None:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            folder = self.model_info.get("tokenizer_path") or ""
            self.chat_template = template_from_folder(folder) or template_for_model(
                str(self.model_info.get("model_path", ""))
            )

    def get_model_info(self) -> dict[str, Any]:
        return self.model_info

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path"))

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def image_token(self) -> str:
        """`/get_model_info`'s image_token where the server says it; ours does not (it says
        has_image_understanding), so LLaVA's `<image>`, the text of LLaVA-1.5's image token."""
        token = self.model_info.get("image_token")
        return token if isinstance(token, str) and token else super().image_token()

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """True once the server emptied its cache (it answers with plain text). empty_cache goes in the
        body, as SGLang's client sends it (SGLang's server then releases freed GPU memory; ours
        ignores it)."""
        with self._open("POST", "/flush_cache", {"empty_cache": empty_cache}) as resp:
            resp.read()
        return True

    def get_server_info(self) -> dict[str, Any]:
        return self._json("GET", "/get_server_info")

    # -- HTTP -----------------------------------------------------------------------------------
    def _request(self, body: dict[str, Any]) -> Any:
        return self._json("POST", "/generate", body)

    def _request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._open("POST", "/generate", body) as resp:
            for raw in resp:  # server-sent events: `data: {...}` lines, then `data: [DONE]`
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk and "text" not in chunk:
                    raise RuntimeError(f"{self.base_url}/generate failed while streaming: {chunk['error']}")
                yield chunk

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        with self._open(method, path, body) as resp:
            data = resp.read()
        return json.loads(data) if data.strip() else None

    def _open(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=TIMEOUT_S, context=self._ssl_context())
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")
            raise RuntimeError(f"{method} {self.base_url}{path}: HTTP {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise ConnectionError(f"{method} {self.base_url}{path}: {e.reason}") from None

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.base_url.startswith("https") or self.verify is None or self.verify is True:
            return None
        if self.verify is False:
            return ssl._create_unverified_context()
        return ssl.create_default_context(cafile=self.verify)
