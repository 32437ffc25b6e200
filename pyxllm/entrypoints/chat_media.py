"""Images in chat messages: OpenAI's ``image_url`` content parts (and vLLM's ``image_pil``) to
PIL images and template-ready messages.

A part ``{"type": "image_url", "image_url": {"url": ...}}`` takes a ``data:image/...;base64,``
URL, a ``file://`` URL under ``--allowed-local-media-path``, or an ``http(s)://`` URL, fetched
(at most :data:`MAX_IMAGE_BYTES` within :data:`FETCH_TIMEOUT_S`) unless ``--no-fetch-media``;
other schemes are refused. ``LLM.chat`` also takes vLLM's
``{"type": "image_pil", "image_pil": <PIL image>}``. Every refusal is an
:class:`~pyxllm.engine.errors.InvalidRequestError` naming the part,
``messages[i].content[j]``, which the server answers with a 400.

The messages handed to the chat template keep the images' places, in one of vLLM's two content
formats, chosen from the template: ``openai`` (the template loops over a message's parts, as
llava-hf's do): the parts stay a list, each image becoming ``{"type": "image"}``; ``string``
(any other template): the content is one string, the model's image token once per image then
the text parts, joined by newlines (vLLM's placement).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from pyxllm.engine.errors import InvalidRequestError
from pyxllm.multimodal_inputs import NO_MEDIA_URLS, MediaPolicy

# a template that iterates a message's content parts renders {"type": "image"} itself
_LOOPS_OVER_PARTS = re.compile(
    r"for\s+\w+\s+in\s+(message|m|msg)(\.content|\[\s*['\"]content['\"]\s*\])"
)
IMAGE_PART_TYPES = ("image_url", "image_pil")
# what an http(s) image URL may take: bytes, and seconds for the whole fetch
MAX_IMAGE_BYTES = 20 * 2**20
FETCH_TIMEOUT_S = 10.0
# the most pixels an image may have, checked before it is decoded (a small PNG of a huge blank
# image would otherwise take gigabytes); 40 MP is a 7,300-pixel square, above any camera's
MAX_IMAGE_PIXELS = 40_000_000


def content_format(chat_template: str | None) -> str:
    """``openai`` when ``chat_template`` loops over a message's content parts, else
    ``string`` (see the module docstring)."""
    return "openai" if chat_template and _LOOPS_OVER_PARTS.search(chat_template) else "string"


def decode_image(data: bytes, where: str):
    """A PIL image (fully read) from encoded bytes (PNG, JPEG, ...).

    Raises:
        InvalidRequestError: bytes PIL cannot read as an image, or one of more than
            :data:`MAX_IMAGE_PIXELS` pixels (naming ``where``).
    """
    from PIL import Image  # lazy: only image requests need PIL

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise InvalidRequestError(
                f"{where}: the image has {width}x{height} pixels, more than the "
                f"{MAX_IMAGE_PIXELS:,} served",
                where,
            )
        image.load()
    except InvalidRequestError:
        raise
    except Image.UnidentifiedImageError as exc:  # PIL's message names its BytesIO object
        raise InvalidRequestError(
            f"{where}: not a readable image (no image format PIL knows)", where
        ) from exc
    except Exception as exc:  # noqa: BLE001 - any failure to read is the request's: a 400
        raise InvalidRequestError(
            f"{where}: not a readable image ({type(exc).__name__}: {exc})", where
        ) from exc
    return image


def load_image_url(url: Any, where: str, media: MediaPolicy = NO_MEDIA_URLS):
    """The image an ``image_url`` URL names (see the module docstring; ``file://`` and
    ``http(s)`` as ``media`` allows).

    Raises:
        InvalidRequestError: a URL that is not a string, bad base64, a scheme not served, a
            ``file://`` path outside ``media.allowed_local_media_path`` (or without it), a
            host (or a redirect's) outside ``media.allowed_media_domains``, a fetch that fails,
            answers other than 200, is too large or too slow, or data that is not an image
            (naming ``where``).
    """
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{where}: image_url.url must be a non-empty string", where)
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidRequestError(
                f"{where}: a data URL must be data:<mime>;base64,<data>", where
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(f"{where}: the data URL is not valid base64", where) from exc
        return decode_image(data, where)
    scheme = urlparse(url).scheme
    if scheme == "file":
        return decode_image(_read_local(url, where, media.allowed_local_media_path), where)
    if scheme in ("http", "https") and media.fetch_media:
        return decode_image(_fetch(url, where, media), where)
    fetched = "" if media.fetch_media else " (this server fetches no URLs: --no-fetch-media)"
    raise InvalidRequestError(
        f"{where}: image URL scheme {scheme or '(none)'!r} is not served{fetched}; send the "
        "image as a data:image/...;base64 URL (or file:// under --allowed-local-media-path)",
        where,
    )


def _fetch(url: str, where: str, media: MediaPolicy) -> bytes:
    """The body of a GET of ``url`` (redirects followed, each to a host ``media`` allows): at
    most :data:`MAX_IMAGE_BYTES`, all of it within :data:`FETCH_TIMEOUT_S`."""
    import httpx  # lazy: only fetched images need it

    def check_host(request: httpx.Request) -> None:
        if not media.allows_host(str(request.url)):
            raise InvalidRequestError(
                f"{where}: image URLs may name only the hosts of --allowed-media-domains "
                f"({', '.join(media.allowed_media_domains)}), not {request.url.host!r}",
                where,
            )

    deadline = time.monotonic() + FETCH_TIMEOUT_S
    size, chunks = 0, []
    too_large = InvalidRequestError(
        f"{where}: the image at the URL is larger than {MAX_IMAGE_BYTES // 2**20} MiB", where
    )
    try:
        client = httpx.Client(
            timeout=FETCH_TIMEOUT_S, follow_redirects=True, event_hooks={"request": [check_host]}
        )
        with client, client.stream("GET", url) as reply:
            if reply.status_code != 200:
                raise InvalidRequestError(
                    f"{where}: fetching the image URL answered HTTP {reply.status_code}", where
                )
            declared = reply.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
                raise too_large
            for chunk in reply.iter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise too_large
                if time.monotonic() > deadline:
                    raise httpx.TimeoutException("the whole fetch took too long")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise InvalidRequestError(
            f"{where}: the image URL could not be fetched within {FETCH_TIMEOUT_S:.0f} s "
            f"({type(exc).__name__}: {exc})",
            where,
        ) from exc
    return b"".join(chunks)


def _read_local(url: str, where: str, allowed: str | None) -> bytes:
    """The bytes of a ``file://`` URL's file, which must lie under ``allowed``."""
    if not allowed:
        raise InvalidRequestError(
            f"{where}: file:// image URLs need the server started with --allowed-local-media-path",
            where,
        )
    root = Path(allowed).resolve()
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(root):
        raise InvalidRequestError(f"{where}: {path} is not under --allowed-local-media-path", where)
    if not path.is_file():
        raise InvalidRequestError(f"{where}: {path}: no such file", where)
    return path.read_bytes()


def extract_chat_images(
    messages: Sequence[Mapping[str, Any]],
    image_token: str | None,
    fmt: str,
    limit: int | None = None,
    media: MediaPolicy = NO_MEDIA_URLS,
) -> tuple[list[dict], list]:
    """The messages for the chat template and their images in order (see the module
    docstring); a message whose content is a list of parts gets text parts joined by newlines
    (``string`` format) or kept as parts (``openai``, where a string content becomes one text
    part).

    Args:
        image_token: the model's image token text; ``None`` for a text model (which refuses
            image parts).
        fmt: ``string`` or ``openai`` (:func:`content_format`).
        limit: the most images (``--limit-mm-per-prompt``); ``None``: no limit here.
        media: see :func:`load_image_url`.

    Raises:
        InvalidRequestError: naming ``messages[i].content[j]``: a part that is not an object,
            of a type other than text and images, a text part without text, an image for a
            text model, one image past ``limit``, or an image that cannot be read.
    """
    out, images = [], []
    for i, message in enumerate(messages):
        entry = dict(message)
        content = entry.get("content")
        if isinstance(content, str) and fmt == "openai":  # the template loops over parts
            entry["content"] = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            out.append(entry)
            continue
        texts, parts, count = [], [], 0
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, Mapping):
                raise InvalidRequestError(f"{where}: expected an object with a 'type'", where)
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"{where}: a text part needs 'text'", where)
                texts.append(part["text"])
                parts.append({"type": "text", "text": part["text"]})
                continue
            if kind not in IMAGE_PART_TYPES:
                raise InvalidRequestError(
                    f"{where}: content parts of type {kind!r} are not supported (served: text, "
                    "image_url)",
                    where,
                )
            if image_token is None:
                raise InvalidRequestError(
                    f"{where}: this model reads text only; image parts are not supported", where
                )
            if limit is not None and len(images) >= limit:
                raise InvalidRequestError(
                    f"{where}: more than {limit} image{'s' if limit != 1 else ''} in one prompt "
                    "(--limit-mm-per-prompt image=N)",
                    where,
                )
            images.append(_part_image(part, kind, where, media))
            parts.append({"type": "image"})
            count += 1
        if fmt == "openai":
            entry["content"] = parts
        else:
            entry["content"] = "\n".join([*([image_token] * count), *texts])
        out.append(entry)
    return out, images


def chat_images(
    messages: Sequence[Mapping[str, Any]], processor, chat_template: str | None
) -> tuple[list[dict], dict | None]:
    """``messages`` ready for the chat template of ``processor`` (the engine's
    ``InputProcessor``), and the prompt's ``multi_modal_data`` (``{"image": [...]}``, ``None``
    without images): what the chat route and ``LLM.chat`` call (see
    :func:`extract_chat_images`; URLs read as the processor's ``media`` policy allows; a text
    model keeps the string format and refuses images).

    Raises:
        InvalidRequestError: see :func:`extract_chat_images`.
    """
    mm = processor.multimodal
    fmt = "string" if mm is None else content_format(chat_template)
    out, images = extract_chat_images(
        messages,
        None if mm is None else mm.placeholder_text,
        fmt,
        None if mm is None else mm.limits["image"],
        NO_MEDIA_URLS if mm is None else mm.media,
    )
    return out, ({"image": images} if images else None)


def _part_image(part: Mapping[str, Any], kind: str, where: str, media: MediaPolicy):
    """The PIL image of an ``image_url`` or ``image_pil`` part."""
    if kind == "image_pil":
        image = part.get("image_pil")
        if not hasattr(image, "convert"):
            raise InvalidRequestError(f"{where}: image_pil must be a PIL image", where)
        return image
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    return load_image_url(url, where, media)
