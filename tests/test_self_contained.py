"""Everything the tests and benchmarks read is inside the repository: no code names a path
beside it (a clone has nothing there), and the model shapes ship with the package."""

from __future__ import annotations

import re
from pathlib import Path

from ragged_placement.planner.models import MODELS_JSON, load_configs

REPO = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile(r"""\.\./\.\./|["']\.\.["']\s*,\s*["']\.\.["']|\.\./shared|["']shared["']\s*,\s*["']models\.json""")


def test_no_code_reads_outside_the_repository():
    found = []
    for folder in ("ragged_placement", "planner", "optim", "benchmarks", "tests", "scripts", "examples"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path != Path(__file__):
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    if OUTSIDE.search(line):
                        found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, found


def test_the_model_shapes_ship_with_the_package():
    path = Path(MODELS_JSON)
    assert path.parent == REPO / "planner" and path.is_file()
    configs = load_configs()
    assert {"gpt2-124m", "llama-3.1-8b", "llama-3.1-405b", "mixtral-8x7b", "deepseek-v3"} <= set(configs)
    assert configs["llama-3.1-8b"]["hidden"] == 4096 and configs["deepseek-v3"]["experts"] == 256
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"ragged_placement.planner" = ["models.json"]' in pyproject
