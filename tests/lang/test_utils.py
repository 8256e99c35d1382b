"""sglbus.utils: the helpers SGLang's examples import from sglang.utils, in SGLang's formats (no network:
a download that cannot happen says how to provide the file)."""

from __future__ import annotations

import pytest
from scripted_backend import ScriptedBackend

import sglbus as sgl
from sglbus.utils import download_and_cache_file, dump_state_text, print_highlight, read_jsonl


def test_read_jsonl_skips_comment_lines(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('# a comment\n{"q": "a?"}\n{"q": "b?", "n": 2}\n')
    assert list(read_jsonl(str(path))) == [{"q": "a?"}, {"q": "b?", "n": 2}]


def test_dump_state_text_writes_each_state_between_separators(tmp_path):
    @sgl.function
    def f(s):
        s += "Hello"

    state = f.run(backend=ScriptedBackend())
    path = tmp_path / "out.txt"
    dump_state_text(str(path), [state, "plain", 3])
    sep = "=" * 80 + "\n\n"
    assert path.read_text() == (
        "=" * 40 + " 0 " + "=" * 40 + "\nHello\n" + sep
        + "=" * 40 + " 1 " + "=" * 40 + "\nplain\n" + sep
        + "=" * 40 + " 2 " + "=" * 40 + "\n3\n" + sep
    )  # fmt: skip


def test_print_highlight_prints(capsys):
    print_highlight("The capital of France is Paris.")
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_download_and_cache_file_takes_local_files_and_explains_a_failed_download(tmp_path):
    data = tmp_path / "hellaswag_val.jsonl"
    data.write_text('{"x": 1}\n')
    assert download_and_cache_file(str(data)) == str(data)
    assert download_and_cache_file(data.as_uri()) == str(data)
    copy = tmp_path / "copy.jsonl"
    assert download_and_cache_file(data.as_uri(), filename=str(copy)) == str(copy)
    assert copy.read_text() == data.read_text()
    with pytest.raises(FileNotFoundError, match="no file"):
        download_and_cache_file(str(tmp_path / "missing.jsonl"))
    cached = tmp_path / "cached.json"
    cached.write_text("{}")  # already there: no download, as SGLang's
    assert download_and_cache_file("https://example.invalid/cached.json", str(cached)) == str(cached)
    target = tmp_path / "new.json"
    with pytest.raises(
        ConnectionError, match=r"cannot download http://127.0.0.1:9/new.json.*put the file at"
    ):
        download_and_cache_file("http://127.0.0.1:9/new.json", str(target))  # nothing listens on port 9
    assert not target.exists() and not (tmp_path / "new.json.partial").exists()
