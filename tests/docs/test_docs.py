"""The documentation cannot rot: every relative link of README*.md and docs/**/*.md
resolves (file and #anchor); English and Chinese cover the same config fields, monitors,
CLI commands and flags, taken from the code (a new field or flag fails here until both
languages document it); every docs page has its Chinese twin; and the examples marked
runnable are run (```python runnable``` and ```sh runnable``` blocks, in order, in one
temporary directory per page, after the ```json file=NAME``` blocks before them are
written), the ```json config``` blocks validated by the library."""

import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Dict, Iterator, List, Pattern, Set, Tuple

import pytest

from support.extras import MATPLOTLIB_PLOT, POLARS_ENGINE, require, require_command

ROOT = Path(__file__).resolve().parents[2]
EN_PAGES = sorted([*ROOT.glob("README.md"), *(p for p in (ROOT / "docs").glob("*.md"))])
ZH_PAGES = sorted([*ROOT.glob("README.zh-CN.md"), *(ROOT / "docs" / "zh").glob("*.md")])
ALL_PAGES = sorted({*ROOT.glob("README*.md"), *(ROOT / "docs").rglob("*.md")})

FENCE = re.compile(r"^(```+|~~~+)(.*)$")
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def split_fences(text: str) -> Iterator[Tuple[str, str]]:
    """(info string or None for prose, text) pieces of a Markdown page."""
    prose: List[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if m:
            yield None, "\n".join(prose)
            prose = []
            marker, info = m.group(1), m.group(2).strip()
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                body.append(lines[i])
                i += 1
            indent = len(lines[i - len(body) - 1]) - len(lines[i - len(body) - 1].lstrip())
            yield info, "\n".join(line[indent:] for line in body)
        else:
            prose.append(lines[i])
        i += 1
    yield None, "\n".join(prose)


def prose_of(path: Path) -> str:
    return "\n".join(t for info, t in split_fences(path.read_text(encoding="utf-8")) if info is None)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").strip().lower()
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "-_" or cat[0] in "LN" or cat == "Mn":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


def anchors_of(path: Path) -> Set[str]:
    seen: Dict[str, int] = {}
    found = set()
    for line in prose_of(path).split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_pages_exist_and_every_english_page_has_a_chinese_twin():
    assert (ROOT / "README.zh-CN.md").is_file()
    en = {p.name for p in (ROOT / "docs").glob("*.md")}
    zh = {p.name for p in (ROOT / "docs" / "zh").glob("*.md")}
    assert en >= {"README.md", "configuration.md", "output-format.md", "monitors.md", "cli.md", "performance.md"}
    assert en == zh, f"only in English: {sorted(en - zh)}; only in Chinese: {sorted(zh - en)}"


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose_of(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


# ------------------------------------------------------------- both languages, from the code
def config_fields() -> Set[str]:
    from msprobe.core.monitor_v2 import config

    fields = set(config._TOP_LEVEL) | set(config._COMMON_FIELDS) | set(config._ALERT_FIELDS)
    for own in config.MONITOR_FIELDS.values():
        fields |= set(own)
    fields |= set(config._SINK_FIELDS) | set(config._SINK_COMMON) | set(config.SINK_BACKENDS)
    for _module, _package, own in config.SINK_BACKENDS.values():
        fields |= set(own)
    return fields


def monitor_names() -> Set[str]:
    from msprobe.core.monitor_v2 import rows
    from msprobe.core.monitor_v2.frameworks import pytorch

    return set(rows.MONITORS) | set(pytorch.MONITORS)


def cli_words() -> Set[str]:
    """Every sub-command and every option string of the analysis CLI's parser."""
    import argparse

    from msprobe.core.monitor_v2.analysis.cli import build_parser

    words = set()
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words.add(name)
                for a in sub._actions:
                    if a.help != argparse.SUPPRESS:
                        words |= {o for o in a.option_strings if o.startswith("--") and o != "--help"}
    return words


def documented(pages: List[Path]) -> Set[str]:
    """Every `code span` of the pages' prose and tables, and words of their code blocks."""
    spans = set()
    for page in pages:
        for info, text in split_fences(page.read_text(encoding="utf-8")):
            if info is None:
                for span in (" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text)):
                    spans.add(span)
                    spans |= set(re.findall(r"--[a-z][a-z0-9-]*|[A-Za-z_][A-Za-z0-9_]*", span))
    return spans


@pytest.mark.parametrize("what", ["config fields", "monitors", "CLI commands and flags"])
def test_both_languages_document_everything_the_code_has(what):
    wanted = {"config fields": config_fields, "monitors": monitor_names, "CLI commands and flags": cli_words}[what]()
    for lang, pages in (("English", EN_PAGES), ("Chinese", ZH_PAGES)):
        missing = sorted(wanted - documented(pages))
        assert not missing, f"{what} not documented in {lang} (as `code`): {missing}"


def test_each_monitor_has_its_own_section_in_both_languages():
    for page in (ROOT / "docs" / "monitors.md", ROOT / "docs" / "zh" / "monitors.md"):
        headings = {re.sub(r"[`\s]", "", m.group(2)) for m in map(HEADING.match, prose_of(page).split("\n")) if m}
        assert monitor_names() <= headings, f"{page.relative_to(ROOT)}: headings {sorted(headings)}"


# --------------------------------------------------------------------------- examples run
def blocks(page: Path) -> List[Tuple[str, str]]:
    return [(info, text) for info, text in split_fences(page.read_text(encoding="utf-8"))
            if info is not None and ("runnable" in info.split() or "config" in info.split()
                                     or any(w.startswith("file=") for w in info.split()))]


PAGES_WITH_EXAMPLES = [p for p in ALL_PAGES if blocks(p)]

# What a page's examples need beyond torch and this package, by what they import, turn on or
# run (declared here, checked before the page's first block: a page whose library is missing
# skips naming it, or fails under MSPROBE_TEST_PROFILE=full): (pattern, module, why).
# An export whose first argument is not --tensorboard writes Parquet, with Polars.
EXAMPLE_NEEDS: List[Tuple[Pattern[str], str, str]] = [
    (re.compile(r"^\s*(?:import|from)\s+mindspore\b", re.M), "mindspore", "the page's example trains a MindSpore cell"),
    (re.compile(r"^\s*(?:import|from)\s+tensorboard\b", re.M), "tensorboard",
     "the page's example reads TensorBoard event files back"),
    (re.compile(r"^msprobe-monitor\s+export\b.*--tensorboard\b", re.M), "tensorboard",
     "the page's example runs export --tensorboard"),
    (re.compile(r"^msprobe-monitor\s+(?:summary|anomalies|diff|plot|export\s+(?!--tensorboard\b))"
                r"(?!.*--engine\s+reference)", re.M), "polars", POLARS_ENGINE),
    (re.compile(r"^msprobe-monitor\s+plot\b", re.M), "matplotlib", MATPLOTLIB_PLOT),
] + [(re.compile(rf'"{sink}"\s*:\s*(?:[Tt]rue|\{{)'), sink,
      f"the page's config turns the {sink} sink on, which the config refuses where {sink} is missing")
     for sink in ("tensorboard", "wandb", "mlflow", "swanlab")]
COMMAND = re.compile(r"^msprobe-monitor\b", re.M)


def require_what_the_examples_need(page: Path, path: str) -> None:
    texts = [text for _info, text in blocks(page)]
    for pattern, module, why in EXAMPLE_NEEDS:
        if any(pattern.search(text) for text in texts):
            require(module, why, load=False)
    if any(COMMAND.search(text) for info, text in blocks(page) if info.split()[0] in ("sh", "bash")):
        require_command("msprobe-monitor", "the page's sh example runs it", path)


def test_english_and_chinese_pages_run_the_same_examples():
    def code(p):
        return [(info, text) for info, text in blocks(p)]
    for en in PAGES_WITH_EXAMPLES:
        rel = en.relative_to(ROOT)
        if rel.parts[:2] == ("docs", "zh") or en.name == "README.zh-CN.md":
            continue
        zh = ROOT / "README.zh-CN.md" if rel == Path("README.md") else ROOT / "docs" / "zh" / rel.name
        assert [i for i, _ in code(zh)] == [i for i, _ in code(en)], f"{rel} and {zh.relative_to(ROOT)}"


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(page, tmp_path):
    from msprobe.core.monitor_v2.config import load_config

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    require_what_the_examples_need(page, env["PATH"])
    for info, text in blocks(page):
        words = info.split()
        where = f"{page.relative_to(ROOT)}, block ```{info}"
        if any(w.startswith("file=") for w in words):
            name = next(w for w in words if w.startswith("file="))[5:]
            (tmp_path / name).write_text(text, encoding="utf-8")
        elif "config" in words:
            cfg = json.loads(text)
            cfg["output_dir"] = str(tmp_path / "config_check")
            load_config(cfg)
        elif words[0] == "python":
            proc = subprocess.run([sys.executable, "-c", text], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=300)
            assert proc.returncode == 0, f"{where}:\n{proc.stdout}\n{proc.stderr}"
            own = [line for line in proc.stderr.splitlines() if "monitor_v2" in line]
            assert all("stopped after" in line for line in own), f"{where}: the monitor warns:\n{proc.stderr}"
        elif words[0] in ("sh", "bash"):
            for line in text.split("\n"):
                command = line.split(" #")[0].strip()
                if not command:
                    continue
                proc = subprocess.run(["/bin/sh", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                                      text=True, timeout=300)
                # 1 is a result (anomalies found, runs differ), 2 and 3 are errors
                assert proc.returncode in (0, 1), f"{where}: {command}\n{proc.stdout}\n{proc.stderr}"
        else:
            raise AssertionError(f"{where}: runnable blocks are python or sh")


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_is_valid_python(page):
    """Blocks that cannot run alone (they need a distributed job, a model of yours) are at
    least valid Python; the runnable ones are run above."""
    for info, text in split_fences(page.read_text(encoding="utf-8")):
        if info is not None and info.split()[:1] == ["python"]:
            compile(text, f"{page.relative_to(ROOT)} ```{info}", "exec")
