"""SGLang's `GenerateReqInput`: one prompt or a batch, as text or token ids, turned into a list of
prompts with their own sampling parameters and request ids. Every problem raises `ValueError` with a
message naming the field and what is allowed (the HTTP layer turns it into a 400)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from services.gateway.logprob_options import FIELDS as LOGPROB_FIELDS
from services.gateway.logprob_options import LogprobOptions, parse_logprob_options
from shared.sampling_params import SamplingParams
from shared.sglang_fields import GENERATE_REQ_INPUT, SGLANG_VERSION, is_default

if TYPE_CHECKING:
    from shared.messages import ImageInput

# fields the engine honours: these, and the logprob fields (one beyond SGLang among them)
SUPPORTED = (
    "text", "input_ids", "sampling_params", "rid", "stream", "log_metrics", "return_prompt_token_ids",
    "require_reasoning", "data_parallel_rank", "image_data", *LOGPROB_FIELDS,
)  # fmt: skip
# the rest of SGLang's fields, which the engine cannot honour yet: accepted at their defaults, else 400
NOT_YET = {k: v for k, v in GENERATE_REQ_INPUT.items() if k not in SUPPORTED}
# samples per prompt: each is a request of its own, so a bound keeps one body from fanning out without
# end (OpenAI's limit)
MAX_N = 128


@dataclass
class Prompt:
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    logprob: LogprobOptions | None = None
    return_prompt_ids: bool = False  # return_prompt_token_ids: the response carries prompt_token_ids
    # require_reasoning: the output starts with the model's reasoning, and a grammar applies after it
    # (the end tag is the server's --reasoning-parser's)
    require_reasoning: bool = False
    # data_parallel_rank: run on this worker (its worker id is the rank's number), not the router's pick
    dp_rank: int | None = None
    # image_data: this prompt's images as sent (an image or a list of them; a vision-language model's);
    # once tokenized (RequestManager.submit), None and image_inputs holds them, expanded into input_ids
    images: list | str | bytes | None = None
    image_inputs: list[ImageInput] | None = None


@dataclass
class GenerateInput:
    prompts: list[Prompt]
    is_batch: bool
    stream: bool


def decode_json(body: bytes) -> Any:
    """A request body as JSON, with the messages HTTP and the bus API both give."""
    if not body:
        raise ValueError("the request body is empty; send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e}") from None


def parse_generate_input(obj: Any, max_states: int | None = None) -> GenerateInput:
    """`max_states`: the gateway's bound on prompts x n (counted before anything is built, so a body of
    250,000 prompts with n 128 is refused in microseconds, not seconds)."""
    if not isinstance(obj, dict):
        raise ValueError("the request body must be a JSON object")
    _check_fields(obj)
    if max_states is not None:
        check_states(_count_prompts(obj), _n_of(obj.get("sampling_params")), max_states)
    items, is_batch = _inputs(obj.get("text"), obj.get("input_ids"))
    n = len(items)
    sp = obj.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != n:
            raise ValueError(f"sampling_params is a list of {len(sp)} for {n} prompts; give one per prompt")
        params = [SamplingParams.from_dict(p) for p in sp]
    else:
        params = [SamplingParams.from_dict(sp)] * n
    stream = obj.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ValueError("stream must be true or false")
    if len({p.n for p in params}) > 1:
        raise ValueError("sampling_params.n must be the same for every prompt of a batch")
    if params[0].n > MAX_N:
        raise ValueError(f"sampling_params.n = {params[0].n} is invalid; allowed: integers in [1, {MAX_N}]")
    logprobs = parse_logprob_options(obj, n)
    if stream and obj.get("return_flat_raw_output_top_logprobs"):
        raise ValueError("return_flat_raw_output_top_logprobs is set on the finished response only; it does "
                         "not support stream: true")  # fmt: skip
    prompt_ids = obj.get("return_prompt_token_ids")
    if prompt_ids is not None and not isinstance(prompt_ids, bool):
        raise ValueError("return_prompt_token_ids must be true or false")
    reasoning = obj.get("require_reasoning")
    if reasoning is not None and not isinstance(reasoning, bool):
        raise ValueError("require_reasoning must be true or false")
    dp_rank = obj.get("data_parallel_rank")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or dp_rank < 0):
        raise ValueError("data_parallel_rank must be a worker's number (an integer >= 0) or null")
    rids, images = _rids(obj.get("rid"), n, is_batch), _image_data(obj.get("image_data"), n, is_batch)
    prompts = [
        Prompt(r, t, i, p, lp, bool(prompt_ids), bool(reasoning), dp_rank, im)
        for r, (t, i), p, lp, im in zip(rids, items, params, logprobs, images, strict=True)
    ]
    # n > 1: one response per sample, grouped prompt by prompt, always a list (as SGLang)
    return GenerateInput(prompts, is_batch or params[0].n > 1, bool(stream))


def check_states(prompts: int, n: int, max_states: int) -> None:
    """A request's states (prompts x n) within the gateway's max_request_states: ValueError (a 400)."""
    if prompts * n > max_states:
        raise ValueError(
            f"a request may ask for at most {max_states} prompts x n (the gateway's max_request_states); "
            f"this one asks for {prompts} x {n} = {prompts * n}: split it"
        )


def _count_prompts(obj: dict[str, Any]) -> int:
    text, ids = obj.get("text"), obj.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return 1


def _n_of(sp: Any) -> int:
    """The n asked for, as far as it reads as one (the full checks come later)."""
    first = sp[0] if isinstance(sp, list) and sp else sp
    n = first.get("n", 1) if isinstance(first, dict) else 1
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def _check_fields(obj: dict[str, Any]) -> None:
    unknown = sorted(k for k in obj if k not in SUPPORTED and k not in NOT_YET)
    if unknown:
        known = ", ".join(SUPPORTED + tuple(NOT_YET))
        raise ValueError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; fields (SGLang {SGLANG_VERSION}'s "
            f"GenerateReqInput): {known}"
        )
    todo = [k for k, default in NOT_YET.items() if not is_default(obj.get(k), default)]
    if todo:
        one = len(todo) == 1
        raise ValueError(
            f"{', '.join(todo)} {'is' if one else 'are'} not supported yet by this server; leave "
            f"{'it' if one else 'them'} unset"
        )


_INT = {int}


def _inputs(text: Any, ids: Any) -> tuple[list[tuple[str | None, list[int] | None]], bool]:
    if (text is None) == (ids is None):
        raise ValueError("exactly one of text and input_ids must be given")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts:
            raise ValueError("text must not be an empty list")
        for t in texts:
            if not isinstance(t, str):
                raise ValueError(f"text must be a string or a list of strings, got {type(t).__name__}")
            if not t:
                raise ValueError("text must not be empty")
        return [(t, None) for t in texts], is_batch
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids must be a non-empty list of token ids or a list of such lists")
    is_batch = isinstance(ids[0], list)
    rows = ids if is_batch else [ids]
    for row in rows:
        if not isinstance(row, list) or not row:
            raise ValueError("input_ids must not contain an empty prompt")
        if not set(map(type, row)) <= _INT:  # (a bool is not an int here; a scan in C, not per id in Python)
            raise ValueError("input_ids must contain integers only")
    return [(None, r) for r in rows], is_batch


def check_vocabulary(ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input_ids contains token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")


_IMAGE = (str, bytes, bytearray)  # base64, a data URL or a file path; bytes from the offline Engine


def _image_data(data: Any, n: int, is_batch: bool) -> list[Any]:
    """Each prompt's images, as SGLang reads image_data: for one prompt an image or a list of them; for a
    batch a list of one entry per prompt (null, an image, or a list of images), or one image for all."""
    if data is None or (isinstance(data, list) and not data):
        return [None] * n
    if not is_batch or isinstance(data, _IMAGE):
        return [_prompt_images(data, "image_data")] * n
    if not isinstance(data, list) or len(data) != n:
        got = f"a list of {len(data)}" if isinstance(data, list) else f"of type {type(data).__name__}"
        raise ValueError(f"image_data is {got} for {n} prompts; give a list of one entry per prompt (null, "
                         "an image, or a list of images)")  # fmt: skip
    return [_prompt_images(d, f"image_data[{i}]") for i, d in enumerate(data)]


def _prompt_images(data: Any, field: str) -> Any:
    """One prompt's entry: None (no images), an image, or a non-empty list of images."""
    if data is None or (isinstance(data, list) and not data):
        return None
    for j, x in enumerate(data if isinstance(data, list) else [data]):
        if not isinstance(x, _IMAGE):
            where, what = (f"{field}[{j}]", "") if isinstance(data, list) else (field, " or a list of images")
            got = "null" if x is None else type(x).__name__
            raise ValueError(f"{where} must be an image (base64, a data URL or a file path){what}, not {got}")
    return data


def _rids(rid: Any, n: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, list):
        if len(rid) != n or not all(isinstance(r, str) and r for r in rid):
            raise ValueError(f"rid must be a string or a list of {n} non-empty strings")
        if len(set(rid)) != n:
            raise ValueError("rid values must be unique within a batch")
        return rid
    if isinstance(rid, str) and rid:
        return [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    raise ValueError("rid must be a non-empty string or a list of strings")
