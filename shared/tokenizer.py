"""Loading the tokenizer that ships with the model folder (tokenizer.json, chat template included)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def load_tokenizer(folder: str) -> Any:
    """A transformers fast tokenizer, from local files only (nothing is downloaded). A folder without
    tokenizer files (a config-only folder for `load_format="dummy"`) gets the default model's tokenizer."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        from shared.model_files import resolve_model_folder

        log.warning("%s has no tokenizer files; using the default model's tokenizer", folder)
        folder = resolve_model_folder(None)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
