"""docs/configuration.md's tables say what the pydantic models say: every field of each model named in its table, no
key the model lacks, and each default written as a literal equal to the model's. And every relative link in every
Markdown file git tracks leads to a file that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from bootstrap.config import BootstrapConfig
from pdcluster.local.spec import LocalSpec, WorkerGroupSpec
from pdcluster.worker.settings import ClusterSettings, KVStoreSettings
from router.config import AdmissionConfig, PriorityClass, RouterConfig, StaticWorker, StoreConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGURATION = REPO / "docs" / "configuration.md"

# The first header cell of each model's table in docs/configuration.md, under the section that holds it.
TABLES: list[tuple[str, str, type[BaseModel]]] = [
    ("## Workers", "`cluster:` key", ClusterSettings),
    ("## Workers", "`kv_store:` key", KVStoreSettings),
    ("## Router", "key", RouterConfig),
    ("## Router", "static worker key", StaticWorker),
    ("## Router", "`store:` key", StoreConfig),
    ("## Router", "`admission:` key", AdmissionConfig),
    ("## Router", "`classes:` key", PriorityClass),
    ("## Bootstrap service", "key", BootstrapConfig),
    ("## Local cluster", "key", LocalSpec),
    ("## Local cluster", "worker group key", WorkerGroupSpec),
]


def table(section: str, first_header: str) -> list[list[str]]:
    """The rows (cells) of the table whose first header cell is `first_header`, in `section` of the document."""
    text = CONFIGURATION.read_text()
    start = text.index(section + " ")
    end = text.find("\n## ", start + 1)
    lines = text[start:end if end > 0 else None].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def documented(rows: list[list[str]]) -> dict[str, str]:
    """key -> its default cell's part (several keys in one row: `a`, `b` with defaults `1`, `2`)."""
    keys: dict[str, str] = {}
    for row in rows:
        names = re.findall(r"`([a-z_]+)`", row[0])
        defaults = row[1].split(", ")
        for i, name in enumerate(names):
            keys[name] = defaults[i] if len(defaults) == len(names) else row[1]
    return keys


@pytest.mark.parametrize(("section", "first_header", "model"), TABLES, ids=[m.__name__ for _, _, m in TABLES])
def test_the_table_names_every_field_of_its_model_and_no_other(section, first_header, model):
    keys = documented(table(section, first_header))
    assert set(keys) == set(model.model_fields), (
        f"{model.__name__}: missing from docs/configuration.md {sorted(set(model.model_fields) - set(keys))}, "
        f"not in the model {sorted(set(keys) - set(model.model_fields))}")


@pytest.mark.parametrize(("section", "first_header", "model"), TABLES, ids=[m.__name__ for _, _, m in TABLES])
def test_the_defaults_written_as_literals_are_the_models(section, first_header, model):
    checked = 0
    for name, cell in documented(table(section, first_header)).items():
        field = model.model_fields[name]
        literal = re.fullmatch(r"`([^`]*)`", cell)
        if field.is_required():
            assert cell == "(required)", f"{model.__name__}.{name}: required, documented as {cell}"
            continue
        assert literal, f"{model.__name__}.{name}: the default {cell!r} is not one literal"
        default = field.get_default(call_default_factory=True)
        written = yaml.safe_load(literal.group(1))
        if isinstance(default, BaseModel):  # a section (`store: {}`): the model the written mapping makes
            written = type(default).model_validate(written)
        elif isinstance(default, dict) and default and isinstance(next(iter(default.values())), BaseModel):
            written = {k: type(next(iter(default.values()))).model_validate(v) for k, v in written.items()}
        elif isinstance(written, str) and not isinstance(default, str):
            written = type(default)(written) if default is not None else written
        assert written == default, f"{model.__name__}.{name}: documented {cell}, the model's default is {default!r}"
        checked += 1
    assert checked


def markdown_files() -> list[Path]:
    """Every Markdown file git tracks."""
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in out.splitlines()]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(REPO)}: links to nothing: {broken}"
