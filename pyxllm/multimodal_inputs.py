"""A prompt's multimodal items as the engine carries them (vLLM's ``MultiModalFeatureSpec``).

An image becomes a run of placeholder tokens in the prompt (one per feature vector the model's
encoder makes of it) and a :class:`MultiModalFeatureSpec` saying where that run is, what the
encoder reads (``pixel_values``) and the image's content hash, which keys the executor's encoder
cache and enters the prefix-cache hash of every KV block the run touches. Values only: no model
code, so the engine, the scheduler and the executor all pass it along.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """Where image URLs in requests may be read from (the server's media flags).

    Attributes:
        allowed_local_media_path: the directory ``file://`` URLs may be read from, and below
            (``--allowed-local-media-path``); ``None``: none.
        fetch_media: whether ``http(s)://`` URLs are fetched (``--fetch-media``).
        allowed_media_domains: the host names ``http(s)://`` URLs (and every redirect) may
            name (``--allowed-media-domains``, vLLM's flag); empty: any host.
    """

    allowed_local_media_path: str | None = None
    fetch_media: bool = True
    allowed_media_domains: tuple[str, ...] = ()

    def allows_host(self, url: str) -> bool:
        """Whether ``url``'s host may be fetched (any host when no domains are set)."""
        host = (urlparse(url).hostname or "").lower()
        return not self.allowed_media_domains or host in self.allowed_media_domains


DEFAULT_MEDIA = MediaPolicy()  # the flags' defaults: http(s) fetched, no file:// URLs
NO_MEDIA_URLS = MediaPolicy(fetch_media=False)  # data: URLs only


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where an item's placeholder tokens are in the prompt: ``[offset, offset + length)``."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class MultiModalFeatureSpec:
    """One multimodal item of a request.

    Attributes:
        modality: ``"image"``.
        identifier: the item's content hash (hex SHA-256 of its processed ``pixel_values``):
            equal images share encoder outputs and prefix-cache blocks, different ones never.
        mm_position: its placeholder run in the prompt; the encoder makes exactly
            ``mm_position.length`` feature vectors of it.
        data: what the model's encoder reads, e.g. ``{"pixel_values": float32 [1, 3, H, W]}``
            (CPU tensors, as the model's image processor made them).
    """

    modality: str
    identifier: str
    mm_position: PlaceholderRange
    data: dict[str, Any]

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part ``[lo, hi)`` of its placeholder run inside the token range ``[start, end)``
        (prompt positions), ``None`` when they do not meet."""
        lo, hi = max(start, self.mm_position.offset), min(end, self.mm_position.end)
        return (lo, hi) if lo < hi else None
