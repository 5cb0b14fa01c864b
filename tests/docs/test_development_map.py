"""``docs/development.md`` (and its Chinese twin) carry the map of the house: every source file
of the package, every benchmark and script, and every test folder is named there, and
nothing named there is gone. A new file fails this test until the map says what it owns."""

import re
from pathlib import Path
from typing import Set

import pytest

from test_docs import ROOT

PACKAGE = ROOT / "src" / "msprobe" / "core" / "monitor_v2"
MAP_HEADINGS = {"docs/development.md": "## Map of the house", "docs/zh/development.md": "## 代码地图"}
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def map_section(page: str) -> str:
    text = (ROOT / page).read_text(encoding="utf-8")
    heading = MAP_HEADINGS[page]
    start = text.find("\n" + heading + "\n")
    assert start >= 0, f"{page} has no '{heading}' section"
    end = text.find("\n## ", start + 1)
    return text[start: end if end >= 0 else len(text)]


def named_paths(section: str) -> Set[str]:
    return {span.rstrip("/") for span in CODE_SPAN.findall(section)}


def source_files() -> Set[str]:
    """Paths the map must name: package files relative to the package, the rest to the repo."""
    found = set()
    for path in PACKAGE.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".c") and "__pycache__" not in path.parts:
            found.add(path.relative_to(PACKAGE).as_posix())
    for folder in ("benchmarks", "scripts"):
        found |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).iterdir()
                  if p.is_file() and p.suffix in (".py", ".sh")}
    found |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").iterdir()
              if p.is_dir() and p.name != "__pycache__"}
    return found


def _exists(name: str) -> bool:
    return (PACKAGE / name).exists() or (ROOT / name).exists()


@pytest.mark.parametrize("page", sorted(MAP_HEADINGS))
def test_the_map_names_every_source_file(page):
    missing = sorted(source_files() - named_paths(map_section(page)))
    assert not missing, f"{page}: the map does not say what these own: {missing}"


@pytest.mark.parametrize("page", sorted(MAP_HEADINGS))
def test_every_file_on_the_map_exists(page):
    # a placeholder such as `frameworks/<fw>/stats.py` stands for several files
    named = {n for n in named_paths(map_section(page))
             if (re.search(r"\.(py|c|sh)$", n) or n.startswith("tests/")) and "<" not in n}
    gone = sorted(n for n in named if not _exists(n))
    assert not gone, f"{page}: the map names files that do not exist: {gone}"


def test_the_two_maps_name_the_same_files():
    en, zh = (named_paths(map_section(p)) for p in sorted(MAP_HEADINGS))
    files = source_files()
    assert en & files == zh & files


def test_a_new_file_would_fail_the_map():
    assert "trainer.py" in source_files() and "benchmarks/overhead.py" in source_files()
    assert "tests/support" in source_files()
