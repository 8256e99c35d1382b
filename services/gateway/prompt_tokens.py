"""The gateway's tokenizer work for one prompt: its ids (given ids checked against the context and the
vocabulary, a text tokenized), a text far too long for the context refused before tokenizing it, and
each token's text on its own (SGLang's return_text_in_logprobs)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from services.gateway.generate_input import Prompt, check_vocabulary


class PromptTokens:
    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int | None) -> None:
        self.tokenizer, self.vocab_size, self.context_len = tokenizer, vocab_size, context_len
        self._texts: dict[int, str] = {}  # token id -> its text alone
        self._token_chars: int | None = None  # see max_token_chars

    def ids(self, p: Prompt) -> list[int]:
        """The prompt's ids; given ids are checked against the context (before a scan of every id)
        and the vocabulary here, a text's against the context by the caller (RequestManager._validate)."""
        if p.input_ids is not None:
            if self.context_len is not None:
                p.sampling.verify_length(len(p.input_ids), self.context_len)
            check_vocabulary(p.input_ids, self.vocab_size)
            return p.input_ids
        assert p.text is not None
        self.refuse_far_too_long(len(p.text))
        ids = self.tokenizer.encode(p.text)
        if not ids:
            raise ValueError(f"text {p.text[:40]!r} has no tokens; send a prompt the tokenizer can encode")
        return ids

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text on its own."""
        cache, out = self._texts, []
        for t in ids:
            text = cache.get(t)
            if text is None:
                text = cache[t] = self.tokenizer.decode([t])
            out.append(text)
        return out

    def token_bytes(self, token: int, text: str) -> list[int]:
        """The token's own bytes (OpenAI's logprob `bytes`): its text's, unless the token is part of a
        UTF-8 character (its text alone is U+FFFD) and the vocabulary says which bytes it stands for:
        a byte-level BPE piece through GPT-2's byte alphabet, or a byte-fallback piece `<0xE2>`."""
        if "\ufffd" not in text:
            return list(text.encode("utf-8"))
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                with contextlib.suppress(ValueError):
                    return [int(piece[3:5], 16)]
            alphabet = _byte_alphabet()
            if piece and all(c in alphabet for c in piece):
                return [alphabet[c] for c in piece]
        return list(text.encode("utf-8"))

    def refuse_far_too_long(self, chars: int) -> None:
        """A text of `chars` characters whose token count cannot fit the context is refused before
        tokenizing it (megabytes take seconds): no token covers more than `max_token_chars` of them."""
        per_token = self.max_token_chars()
        if per_token is None or self.context_len is None:
            return
        at_least = chars // per_token
        if at_least >= self.context_len:
            raise ValueError(
                f"the prompt has at least {at_least} tokens ({chars} characters); at most "
                f"{self.context_len - 1} fit the context length ({self.context_len})"
            )

    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for (with a margin for the leading space a
        decode may drop), or None when a normalizer could shrink the text before tokenizing. The first
        call decodes the whole vocabulary (~0.4 s)."""
        if self._token_chars is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None or backend.normalizer is not None:
                self._token_chars = 0
            else:
                texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
                self._token_chars = max(map(len, texts)) + 2
        return self._token_chars or None


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, read backwards: the character each byte is written as -> the byte
    (printable ASCII and Latin-1 stand for themselves, the other bytes for U+0100 onwards)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]  # fmt: skip
    out, extra = {}, 0
    for b in range(256):
        if b in kept:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out
