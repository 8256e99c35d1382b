"""Images in `/v1/chat/completions`, as OpenAI and SGLang take them: a user message's content may hold
`{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "auto"}}` parts (or
`"image_url": "<url>"`, as some clients send) beside its text parts, for a vision-language model
(`RequestManager.images` set).

Each part's url goes, in the order of the parts through the conversation, into the request's `image_data`,
decoded and checked later as `/generate`'s (shared/media.py). The server is offline: an http(s) (or any
`scheme://`) url is refused here, named by its part. `detail` is accepted and ignored (LLaVA-1.5 sees
every image at its tower's one size).

In the rendered prompt each part becomes the model's image token where the template puts it. A chat
template that reads typed content parts (it loops over `message['content']`, as llava-hf's do) is given
every message as HF's processors give it, `{"type": "text", "text": ...}` and `{"type": "image"}`, and
writes the token itself (llava-1.5's: `<image>\\n` for each image, before the message's text); any other
template gets each message as one string with the token's text where each image part was."""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, NamedTuple

from services.gateway.openai_errors import OpenAIError
from shared.media import MediaError

if TYPE_CHECKING:
    import jinja2.nodes

IMAGE_PART = {"type": "image"}  # an image in a message, as HF's chat templates read it
DETAILS = ("auto", "low", "high")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # http://, https://, file://: never fetched or opened
_SENT_AS = "send the image as a data URL (data:image/png;base64,...) or as base64"
# transformers' own tag for assistant masks; plain Jinja cannot parse it, and it changes no output
_GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")
_IMAGE_DATA_ITEM = re.compile(r"image_data\[(\d+)\]")


class ChatImage(NamedTuple):
    """One image part: its url as the client sent it, and where it was (the param of a refusal)."""

    url: str
    param: str  # messages[i].content[j].image_url


def content_parts(
    content: list[Any], i: int, role: str, takes_images: bool, images: list[ChatImage]
) -> str | list[dict[str, str]]:
    """A message's list content: its text parts joined into one string when it has only text (what
    a text model's template reads); else its parts in order, text and `IMAGE_PART`, with each image's
    url appended to `images`. takes_images: the model is a vision-language model."""
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise OpenAIError(f"{where}.text must be a string", "messages")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            images.append(ChatImage(_image_url(part, where, role, takes_images), f"{where}.image_url"))
            parts.append(dict(IMAGE_PART))
        else:
            allowed = "text, image_url" if takes_images else "text (this model takes no images)"
            raise OpenAIError(f"{where} has type {kind!r}; allowed: {allowed}", "messages")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_url(part: dict[str, Any], where: str, role: str, takes_images: bool) -> str:
    """The part's url, checked as far as it can be without decoding it (RequestManager decodes it)."""
    if not takes_images:
        raise OpenAIError(
            f"{where} is an image (type 'image_url'); this model (a text model: its config.json names no "
            "vision tower) takes no images: send text parts only, or serve a vision-language model "
            "(LlavaForConditionalGeneration)",
            "messages",
        )
    if role != "user":
        raise OpenAIError(f"{where}: image_url parts are allowed in user messages only, not in a {role} "
                          "message", where)  # fmt: skip
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    param = f"{where}.image_url"
    if not isinstance(url, str) or not url.strip():
        raise OpenAIError(
            f'{param} must be {{"url": <the image>, "detail": "auto" | "low" | "high"}} or the url as a '
            f"string; {_SENT_AS}",
            param,
        )
    detail = spec.get("detail") if isinstance(spec, dict) else None
    if detail is not None and detail not in DETAILS:
        raise OpenAIError(f"{param}.detail = {detail!r} is invalid; allowed: {', '.join(DETAILS)}",
                          f"{param}.detail")  # fmt: skip
    if _SCHEME.match(url.strip()):
        raise OpenAIError(f"{param}: URLs are not fetched (this server is offline); {_SENT_AS}", param)
    return url


def template_messages(
    messages: list[dict[str, Any]], image_token: str, takes_parts: bool
) -> list[dict[str, Any]]:
    """The messages as the model's chat template reads them: every content as a list of typed parts
    for a template that loops over them (a string would render as nothing there), else every content
    as a string, with `image_token` (its text) where each image part was."""
    if takes_parts:
        return [{**m, "content": _as_parts(m["content"])} for m in messages]
    return [{**m, "content": _as_text(m["content"], image_token)} for m in messages]


def _as_parts(content: str | list[dict[str, str]]) -> list[dict[str, str]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


def _as_text(content: str | list[dict[str, str]], image_token: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(image_token if p["type"] == "image" else p["text"] for p in content)


def image_parts(messages: list[dict[str, Any]]) -> int:
    """How many image parts the messages hold (each must become one image token)."""
    return sum(p["type"] == "image" for m in messages if isinstance(m["content"], list) for p in m["content"])


def content_chars(content: str | list[dict[str, str]]) -> int:
    """The characters of a message's text (an image part counts as none: the context check of its
    slots comes once the prompt is expanded)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(p.get("text", "")) for p in content)


def check_image_tokens(ids: list[int], token_id: int, token: str, parts: int) -> None:
    """The rendered prompt holds one image token per image part. More: the text holds the token's text
    itself (it would claim an image that was never sent); fewer: the template dropped an image part, or
    the tokenizer does not encode the token's text as the model's image token id."""
    found = ids.count(token_id)
    if found > parts:
        raise OpenAIError(
            f"messages: the rendered prompt has {found} image tokens ({token}, id {token_id}) for {parts} "
            f"image_url parts: the text holds {token!r} itself; send each image as an image_url part and "
            f"leave {token!r} out of the text",
            "messages",
        )
    if found < parts:
        raise OpenAIError(
            f"messages: {parts} image_url parts but the model's chat template and tokenizer give "
            f"{found} image tokens ({token}, id {token_id}); the model folder's tokenizer must encode "
            f"{token!r} as id {token_id} (an added token in tokenizer.json)",
            "messages",
        )


def image_error(e: MediaError, params: tuple[str, ...]) -> OpenAIError:
    """A refused image of a chat, named by the part it came from: RequestManager names the request's
    images image_data[k], a field the chat never had. Without params (a completion), as it is."""
    item = _IMAGE_DATA_ITEM.fullmatch(e.field)
    param = params[int(item[1])] if item and int(item[1]) < len(params) else "messages" if params else None
    if param is None:
        return OpenAIError(str(e))
    return OpenAIError(param + str(e)[len(e.field) :], param)


@functools.lru_cache(maxsize=16)
def template_takes_parts(template: str | None) -> bool:
    """Whether the chat template reads a message's content as a list of typed parts: it loops over
    `message['content']` (or `message.content`, through filters, slices, or a variable set to it), the
    test vLLM and SGLang use. A template that Jinja cannot parse here is read as a string template.
    (Jinja is imported here: the gateway needs it only where transformers renders chat templates.)"""
    if not isinstance(template, str):
        return False
    import jinja2
    import jinja2.nodes as nodes

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # {% break %}: as transformers
    try:
        tree = env.parse(_GENERATION_TAG.sub("", template))
    except jinja2.TemplateSyntaxError:
        return False
    aliases = {
        a.target.name
        for a in tree.find_all(nodes.Assign)
        if isinstance(a.target, nodes.Name) and _reads_content(a.node, set())
    }
    return any(_reads_content(loop.iter, aliases) for loop in tree.find_all(nodes.For))


def _reads_content(node: jinja2.nodes.Node | None, aliases: set[str]) -> bool:
    """node is `x['content']`, `x.content` or a variable set to one, under filters, tests and slices."""
    import jinja2.nodes as nodes

    while isinstance(node, nodes.Filter | nodes.Test) or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
    ):
        node = node.node
    if isinstance(node, nodes.Name):
        return node.name in aliases
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Getattr) and node.attr == "content"
