"""The chat page at ``GET /``: a single page (``static/``: HTML, CSS and our own script, no
build step, nothing fetched from elsewhere) that talks to the same server's
``POST /v1/chat/completions`` from the browser. ``--disable-web-ui`` leaves it out, and ``/``
answers as any unknown path does.

The page's files are public (they hold no data), so a server with ``--api-key`` serves them
without a key; the page then sends the key the user types in its settings. The HTML carries a
Content-Security-Policy that allows only this server's own scripts, styles and connections:
even a bug in the page's markdown rendering could not run a script that model output brought.
"""

from __future__ import annotations

import pathlib

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = pathlib.Path(__file__).with_name("static")
STATIC_PREFIX = "/static"
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


async def chat_page() -> FileResponse:
    """The chat page's HTML."""
    return FileResponse(
        STATIC_DIR / "index.html",
        headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache",
        },
    )


def install_web_ui(app: FastAPI) -> frozenset[str]:
    """Serve the chat page at ``/`` and its files under ``/static/`` on ``app``; returns the
    paths it serves (which need no API key)."""
    app.add_api_route("/", chat_page, methods=["GET"], include_in_schema=False)
    app.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="static")
    files = (path.name for path in STATIC_DIR.iterdir() if path.is_file())
    return frozenset({"/", *(f"{STATIC_PREFIX}/{name}" for name in files)})
