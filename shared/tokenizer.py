"""Loading the tokenizer that ships with the model folder (tokenizer.json, chat template included)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(folder: str) -> Any:
    """A transformers fast tokenizer, from local files only (nothing is downloaded)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
