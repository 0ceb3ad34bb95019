"""The Python blocks the README and docs/ show, read from their Markdown, and how the tests run them.

A block is a fenced ```` ```python ```` block. Every block runs as written, on CPU, from an empty
working directory (``tests/test_documented_python.py``), unless its first line marks it a
fragment on purpose, with the reason: ``# fragment: <why it cannot run alone>`` (a field of a
larger declaration, a line of a loop shown above, code that needs eight GPUs).
docs/conventions.md says when a block may be one.

Blocks that start processes (``fabric.launch()``, ``trainer.fit(...)``) run each as its own
script, since Lightning starts the other ranks by running the script again. The others run one
after the other in one process (``run_all``), each as ``__main__`` with fresh globals and any
process group destroyed after it, so that the imports are paid once.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "# fragment:"
# What starts ranks: Lightning re-runs the script for each, so the block must be a file of its own.
STARTS_PROCESSES = re.compile(r"\.launch\(|\.fit\(")


@dataclass(frozen=True)
class PythonBlock:
    source: str  # docs/fabric.md:15, the line of the opening fence
    code: str

    @property
    def fragment_reason(self) -> str | None:
        """The reason after ``# fragment:`` on the first line; None for a block that must run."""
        first = self.code.splitlines()[0].strip() if self.code.strip() else ""
        return first[len(FRAGMENT):].strip() if first.startswith(FRAGMENT) else None

    @property
    def starts_processes(self) -> bool:
        return bool(STARTS_PROCESSES.search(self.code))


def python_blocks(documents: list[Path] = DOCUMENTS) -> list[PythonBlock]:
    """Every ```` ```python ```` block of ``documents``, in order (an indented fence, in a list, included)."""
    blocks = []
    for document in documents:
        lines = document.read_text().splitlines()
        index = 0
        while index < len(lines):
            opening = re.match(r"^(\s*)```python\s*$", lines[index])
            index += 1
            if not opening:
                continue
            indent, start, body = len(opening.group(1)), index, []
            while index < len(lines) and lines[index].strip() != "```":
                line = lines[index]
                body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())  # a list item's indent
                index += 1
            index += 1
            blocks.append(PythonBlock(f"{document.relative_to(ROOT)}:{start}", "\n".join(body) + "\n"))
    return blocks


def run_all(blocks: list[dict]) -> None:
    """Run each block as ``__main__`` in this process; exits non-zero naming each block that failed."""
    import torch.distributed as dist

    failed = []
    for block in blocks:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a block's warnings are the docs' business, not this runner's
                exec(compile(block["code"], block["source"], "exec"), {"__name__": "__main__"})
        except BaseException:  # noqa: BLE001 - SystemExit included: every block is reported
            failed.append(f"{block['source']}:\n{traceback.format_exc()}")
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    if failed:
        sys.exit("\n".join(failed))


if __name__ == "__main__":
    run_all(json.loads(Path(sys.argv[1]).read_text()))
