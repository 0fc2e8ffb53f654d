"""The code blocks of the README and the docs/ pages, sorted by the test that runs them.

Every shell and Python block a reader can copy is run as written by one test module:

- ``cli``: lines of ``.venv/bin/diffusion`` and ``client``: Python blocks that talk to a worker
  (``test_docs_examples.py``, in the order each page shows them);
- ``grpcurl``: lines of ``.venv/bin/grpcurl`` (``test_docs_grpcurl.py``);
- ``openai``: the curl lines (``NAME=$(curl ...)`` and ``until curl ...`` too, which take a job's id
  and poll it) and the OpenAI SDK blocks on the HTTP port (the README's in ``test_openai_api.py``,
  docs/'s in ``test_docs_http.py``);
- ``make``: lines of ``make`` (``test_docs_pages.py`` checks each names a Makefile target).

Anything else is ``None``: ``test_docs_pages.py`` fails on it, so no example goes unrun.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness.processes import REPO

# The pages whose examples are run: the README first, then docs/ in name order.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE_LANGUAGES = ("sh", "bash", "console", "shell", "python", "py")
CLI = ".venv/bin/diffusion "
GRPCURL = ".venv/bin/grpcurl "
HTTP_PORT = "localhost:8000"
# How each line of a shell block on the HTTP port starts.
HTTP_LINE = re.compile(r"curl |python3 |\w+=\$\(curl |until curl ")


@dataclass(frozen=True)
class Block:
    page: Path
    language: str
    code: str

    @property
    def lines(self) -> list[str]:
        """The block's lines, stripped, blank ones and trailing ``# comments`` left out."""
        return [line.split("  #", 1)[0].strip() for line in self.code.splitlines() if line.strip()]

    @property
    def kind(self) -> str | None:
        lines = self.lines
        if self.language in ("python", "py"):
            return "openai" if "from openai import OpenAI" in self.code else "client"
        if not lines:
            return None
        for kind, prefix in (("cli", CLI), ("grpcurl", GRPCURL), ("make", "make ")):
            if all(line.startswith(prefix) for line in lines):
                return kind
        if HTTP_PORT in self.code and all(HTTP_LINE.match(line) for line in lines):
            return "openai"
        return None


def blocks(page: Path) -> list[Block]:
    """``page``'s fenced blocks in a runnable language, in order (indented fences included); a block
    without a language (a diagram, a tree) is not code."""
    found = re.findall(r"^ *```(\w*)\n(.*?)^ *```", page.read_text(), flags=re.S | re.M)
    return [Block(page, language, code) for language, code in found if language in RUNNABLE_LANGUAGES]


def of_kind(kind: str, pages: list[Path] = PAGES) -> list[Block]:
    return [block for page in pages for block in blocks(page) if block.kind == kind]
