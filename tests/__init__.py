"""The project's tests. REPO: the repository's root, where the tests find its files."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
