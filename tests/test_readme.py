"""The README stays a newcomer's page: the two set-up commands first, at most 12,000 bytes
(reference material lives in docs/), and every page it links to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    text = README.read_text()
    opening = text.splitlines()[:6]
    assert any(line.startswith("make serve") for line in opening)
    assert any(line.startswith("make test") for line in opening)
    assert len(text.encode()) <= 12_000, "move reference material from README.md to docs/"


def test_every_local_link_of_the_readme_exists():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local  # the docs pages
    assert [t for t in local if not (ROOT / t).exists()] == []
