"""The helpers SGLang's frontend examples and benchmarks import from `sglang.utils`, at the same path:
`read_jsonl`, `dump_state_text`, `print_highlight`, `download_and_cache_file`. Nothing else of the
project lives here."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

DOWNLOAD_TIMEOUT_S = 60.0


def read_jsonl(filename: str) -> Iterator[Any]:
    """The JSON value of each line, skipping lines that start with `#` (as SGLang's)."""
    with open(filename, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                yield json.loads(line)


def dump_state_text(filename: str, states: Iterable[Any], mode: str = "w") -> None:
    """Each state's text (a ProgramState's `text()`, a string, or str() of anything else) between
    numbered separator lines, SGLang's format."""
    from sglbus.lang.state import ProgramState

    with open(filename, mode, encoding="utf-8") as f:
        for i, s in enumerate(states):
            text = s if isinstance(s, str) else s.text() if isinstance(s, ProgramState) else str(s)
            f.write("=" * 40 + f" {i} " + "=" * 40 + "\n" + text + "\n" + "=" * 80 + "\n\n")


def print_highlight(text: Any) -> None:
    """Print text (SGLang's renders it as bold HTML in its CI notebooks; a terminal gets it plain)."""
    print(text)


def download_and_cache_file(url: str, filename: str | None = None) -> str:
    """The local path of url's file. A local path or a `file://` URL is read where it is (copied to
    filename when one is given); an http(s) URL is downloaded to filename (default /tmp/<its name>)
    unless that file exists already. Without network access, put the file there beforehand or pass its
    local path: a failed download raises ConnectionError saying so."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("", "file"):
        source = urllib.request.url2pathname(parsed.path) if parsed.scheme == "file" else url
        if not os.path.isfile(source):
            raise FileNotFoundError(f"download_and_cache_file: no file {source!r}")
        if filename is None or os.path.abspath(filename) == os.path.abspath(source):
            return source
        if not os.path.exists(filename):
            shutil.copyfile(source, filename)
        return filename
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"download_and_cache_file: cannot fetch {url!r} (http, https, file or a local path)")
    if filename is None:
        filename = os.path.join("/tmp", os.path.basename(parsed.path) or "download")
    if os.path.exists(filename):
        return filename
    partial = filename + ".partial"
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp, open(partial, "wb") as f:
            shutil.copyfileobj(resp, f)
    except (urllib.error.URLError, OSError) as e:
        if os.path.exists(partial):
            os.remove(partial)
        reason = getattr(e, "reason", e)
        raise ConnectionError(
            f"download_and_cache_file: cannot download {url}: {reason}. Without network access, put the file "
            f"at {filename} first, or pass its local path (or a file:// URL)"
        ) from None
    os.replace(partial, filename)
    return filename
