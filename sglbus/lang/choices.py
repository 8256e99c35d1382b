"""How `select` picks one of its choices from the logprobs of `prompt + choice`.

The backend asks the runtime for the prompt logprobs of every continuation in one batched request;
a method turns those rows into a decision. A row is the runtime's `input_token_logprobs`:
`[logprob, token_id, token_text]` per token, the first one or two being the prompt's last tokens.
The three methods are SGLang's:

- token_length_normalized: the highest mean logprob per token (the default);
- greedy_token_selection: compare token by token, keep the best at each position (a shorter choice
  is padded with its own mean), so a choice that is a prefix of a longer one is judged fairly;
- unconditional_likelihood_normalized: the highest mean of logprob(token | prompt) minus
  logprob(token | nothing), which discounts choices that are likely whatever the question.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

Row = list[list[Any]]  # [[logprob | None, token_id, text | None], ...]


@dataclass
class ChoiceDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoiceMethod(ABC):
    needs_unconditional: bool = False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[Row],
        output_token_logprobs: list[Row],
        unconditional_token_logprobs: list[Row] | None = None,
    ) -> ChoiceDecision: ...

    def __repr__(self) -> str:
        return type(self).__name__


def mean_logprob(row: Row) -> float:
    """Mean of the known logprobs of a row (the very first token of a text has none)."""
    values = [t[0] for t in row if t[0] is not None]
    return sum(values) / len(values) if values else float("-inf")


def trim_prompt_token(prompt: str, row: Row) -> Row:
    """The row without its first entry when that entry is the prompt's own last token: the request
    asked from two tokens before the prompt's end, in case the choice merged with the prompt's last
    token when tokenized (token healing); when it did not, the extra token is not part of the choice."""
    if len(row) > 1 and row[0][2] is not None and prompt.endswith(row[0][2]):
        return row[1:]
    return row


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)  # the first of equals, as numpy's argmax


def _meta(normalized: list[float], inputs: list[Row], outputs: list[Row]) -> dict[str, Any]:
    return {
        "normalized_prompt_logprobs": normalized,
        "input_token_logprobs": inputs,
        "output_token_logprobs": outputs,
    }


class TokenLengthNormalized(ChoiceMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoiceDecision:  # fmt: skip
        best = _argmax(normalized_prompt_logprobs)
        meta = _meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoiceDecision(choices[best], meta)


class GreedyTokenSelection(ChoiceMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoiceDecision:  # fmt: skip
        matrix = greedy_matrix(input_token_logprobs)
        best = greedy_pick(matrix)
        meta = _meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoiceDecision(choices[best], meta)


def greedy_matrix(rows: list[Row]) -> list[list[float]]:
    """One line of logprobs per choice, the shorter ones padded with their own mean."""
    width = max(len(r) for r in rows)
    matrix = []
    for row in rows:
        values = [t[0] if t[0] is not None else 0.0 for t in row]
        pad = sum(values) / len(values) if values else 0.0
        matrix.append(values + [pad] * (width - len(values)))
    return matrix


def greedy_pick(matrix: list[list[float]]) -> int:
    """Position by position, keep the choices with the best logprob there, until one is left."""
    alive = list(range(len(matrix)))
    for j in range(len(matrix[0])):
        best = max(matrix[i][j] for i in alive)
        alive = [i for i in alive if matrix[i][j] == best]
        if len(alive) == 1:
            break
    return alive[0]


class UnconditionalLikelihoodNormalized(ChoiceMethod):
    needs_unconditional = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoiceDecision:  # fmt: skip
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = [
            unconditional_score(cond, uncond)
            for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True)
        ]
        meta = _meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoiceDecision(choices[_argmax(scores)], meta)


def unconditional_score(cond: Row, uncond: Row) -> float:
    """Mean over the tokens of logprob(token | prompt) - logprob(token | the choice's tokens alone);
    the first unconditioned token has no logprob and counts as 0."""
    if len(cond) != len(uncond):
        raise ValueError(f"{len(cond)} conditional logprobs but {len(uncond)} unconditional ones")
    diffs = [(c[0] or 0.0) - (u[0] or 0.0) for c, u in zip(cond, uncond, strict=True)]
    return sum(diffs) / len(diffs)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

# SGLang's names, for programs that import them
ChoicesSamplingMethod = ChoiceMethod
ChoicesDecision = ChoiceDecision
