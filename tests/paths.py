"""Where the repository is, for tests at any depth of the tests/ tree."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
