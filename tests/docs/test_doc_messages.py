"""The ``ConfigError`` messages the docs show are the ones the library prints (issue 26,
item 8): every line of README*.md and docs/**/*.md (both languages) holding
``monitor_v2 config: `` is checked against ``load_config`` on the config that produces
it. A message ending in ``...`` is a prefix of the real one (a long list of known
fields cut short); otherwise the two are equal. A documented message with no config
below fails the test: add the config that produces it to CASES."""

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from msprobe.core.monitor_v2.config import load_config
from msprobe.core.monitor_v2.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("README*.md"), *(ROOT / "docs").rglob("*.md")])
MARK = "monitor_v2 config: "
# an ``output_dir`` made world-writable (mode 0777) under tmp_path, shown as this path
SHARED_DIR = "/tmp/shared"

# the start of a documented message (after MARK) -> a config that produces it
CASES: Dict[str, dict] = {
    "field 'step_interval' = '2' (str)": {"step_interval": "2"},
    "field 'step_interval' = '5' (str)": {"step_interval": "5"},
    "unknown field 'start_stpe'": {"start_stpe": 1},
    "unknown field 'monitors.module.target'": {"monitors": {"module": {"target": ["blocks.0"]}}},
    "unknown field 'monitors.weight_grad.enable'": {"monitors": {"weight_grad": {"enable": True}}},
    # docs/long-runs.md, "Security": a real directory that group and others can write,
    # shown in the docs as /tmp/shared
    "field 'output_dir' = '/tmp/shared'": {"output_dir": SHARED_DIR},
    # docs/moe-experts.md: a grouped-expert pattern that is not a regular expression
    "field 'monitors.param.expert_params[0]' = 'experts(' (str)": {
        "monitors": {"param": {"enabled": True, "expert_params": ["experts("]}}},
}


def documented() -> List[Tuple[str, str]]:
    """(where, message) for every documented message; a message ends at the end of the
    line, or at the closing backtick of an inline code span."""
    found = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            start = line.find(MARK)
            if start < 0:
                continue
            text = line[start + len(MARK):]
            inline = line[:start].count("`") % 2 == 1
            if inline:
                text = text.split("`", 1)[0]
            if text.strip():  # not the marker itself, named in prose (docs/development.md)
                found.append((f"{page.relative_to(ROOT)}:{n}", text.rstrip()))
    return found


def real_message(cfg: dict, tmp_path: Path) -> str:
    out = str(tmp_path / "out")
    if cfg.get("output_dir") == SHARED_DIR:
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        out = str(shared)
    with pytest.raises(ConfigError) as info:
        load_config({**cfg, "output_dir": out})
    message = str(info.value).replace(out, SHARED_DIR)
    assert message.startswith(MARK), message
    return message[len(MARK):]


def test_the_docs_show_config_error_messages():
    where = {w.split(":")[0] for w, _ in documented()}
    # both languages document them (the test below would pass vacuously otherwise)
    assert "docs/configuration.md" in where and "docs/zh/configuration.md" in where, where
    assert "docs/cli.md" in where and "docs/zh/cli.md" in where, where


@pytest.mark.parametrize("where, message", documented(), ids=lambda v: v if ":" in str(v) else None)
def test_documented_config_error_is_the_real_message(tmp_path, where, message):
    keys = [k for k in CASES if message.startswith(k)]
    assert keys, f"{where}: no config in CASES produces {message!r}; add one"
    real = real_message(CASES[max(keys, key=len)], tmp_path)
    if message.endswith("..."):
        assert real.startswith(message[:-3].rstrip()), f"{where}:\n  documented: {message}\n  real:       {real}"
    else:
        assert real == message, f"{where}:\n  documented: {message}\n  real:       {real}"


def test_a_stale_message_would_fail(tmp_path):
    """The check compares text, not only prefixes: the message the docs showed before
    issue 26 (without the range) is not the real one any more."""
    stale = "field 'step_interval' = '2' (str): must be an integer >= 1"
    real = real_message(CASES["field 'step_interval' = '2' (str)"], tmp_path)
    assert real != stale and real.startswith(stale)
    assert re.search(r"\(at most \d+\)$", real)
