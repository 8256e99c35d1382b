"""The gateway's per-token work on the default model's tokenizer (no server): a token's own bytes for
OpenAI's logprob `bytes`, where a token that is part of a UTF-8 character has U+FFFD as its text."""

from __future__ import annotations

from services.gateway.prompt_tokens import PromptTokens
from shared.tokenizer import load_tokenizer


def test_token_bytes_add_up_to_the_text_even_inside_a_character(model_folder):
    tok = load_tokenizer(model_folder)
    pt = PromptTokens(tok, len(tok), 8192)
    for text in ("naïve 日本語 🦜", "plain words"):
        ids = tok.encode(text, add_special_tokens=False)
        texts = pt.token_texts(ids)
        assert b"".join(bytes(pt.token_bytes(t, s)) for t, s in zip(ids, texts, strict=True)) == text.encode()
    ids = tok.encode("🦜", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in pt.token_texts(ids)[0]  # the case this is for: a partial character
