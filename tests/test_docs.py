"""The docs stay true to the tree: CONTRIBUTING's map names every module of the FSDP runtime
and of the packages, and every relative link in README.md, CONTRIBUTING.md and docs/ reaches a file (and heading)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def test_contributing_names_every_module_of_the_fsdp_runtime():
    text = (REPO / "CONTRIBUTING.md").read_text()
    table = text[text.index("The FSDP runtime (`ragged_placement/fsdp/`"):]
    table = table[: table.index("\n## ")]
    named = set(re.findall(r"`(\w+\.py)`", table))
    modules = {p.name for p in (REPO / "ragged_placement" / "fsdp").glob("*.py")} - {"__init__.py"}
    assert modules - named == set(), f"CONTRIBUTING.md's fsdp table leaves out {sorted(modules - named)}"
    assert named - modules == set(), f"CONTRIBUTING.md's fsdp table names missing {sorted(named - modules)}"


def test_contributing_names_every_module_of_the_packages():
    text = (REPO / "CONTRIBUTING.md").read_text()
    section = text[text.index("## Where things are"):]
    section = section[: section.index("\n## ", 1)]
    named = set(re.findall(r"(\w+\.py)\b", section))
    missing = []
    for folder in ("ragged_placement", "planner", "optim", "ragged_placement/integrations/torchtitan"):
        for path in sorted((REPO / folder).glob("*.py")):
            if path.name != "__init__.py" and path.name not in named:
                missing.append(f"{folder}/{path.name}")
    assert not missing, f"CONTRIBUTING.md's map leaves out {missing}"


def test_every_relative_link_reaches_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken
