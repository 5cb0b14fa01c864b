"""``msprobe-monitor control CONFIG``: validate the edit, then replace the file atomically."""

import io
import json
import os
import stat

from msprobe.core.monitor_v2.analysis.cli import main


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def config(tmp_path, **fields):
    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "dynamic": True,
                                "monitors": {"weight_grad": {"enabled": True}}, **fields}))
    return path


def test_enable_module_for_steps(tmp_path):
    path = config(tmp_path)
    inode = os.stat(path).st_ino
    code, out, err = run("control", str(path), "--enable", "module", "--targets", "blocks.3", "--steps", "20",
                         "--set", "step_interval=5")
    assert code == 0, err
    raw = json.loads(path.read_text())
    entry = raw["monitors"]["module"]
    assert entry["enabled"] is True and entry["targets"] == ["blocks.3"] and entry["steps"] == 20
    assert "_armed" in entry and raw["step_interval"] == 5
    assert raw["monitors"]["weight_grad"] == {"enabled": True}
    assert os.stat(path).st_ino != inode  # replaced, not rewritten in place
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert "monitors.module.steps = 20" in out and "step_interval = 5" in out
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert not (tmp_path / "out").exists()  # validation creates nothing


def test_disable(tmp_path):
    path = config(tmp_path)
    code, out, _ = run("control", str(path), "--disable", "weight_grad")
    assert code == 0 and json.loads(path.read_text())["monitors"]["weight_grad"]["enabled"] is False


def test_invalid_edit_exits_2_and_leaves_the_file(tmp_path):
    path = config(tmp_path)
    before = path.read_bytes()
    code, _, err = run("control", str(path), "--enable", "module", "--steps", "0")
    assert code == 2 and "monitors.module.steps" in err
    code, _, err = run("control", str(path), "--set", "step_interval=0")
    assert code == 2 and "step_interval" in err
    code, _, err = run("control", str(path), "--enable", "modul")
    assert code == 2 and "did you mean 'module'" in err
    code, _, err = run("control", str(path), "--targets", "x")
    assert code == 2 and "--enable" in err
    assert path.read_bytes() == before


def test_symlink_refused(tmp_path):
    real = config(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    before = real.read_bytes()
    code, _, err = run("control", str(link), "--enable", "module")
    assert code == 2 and "symbolic link" in err
    assert link.is_symlink() and real.read_bytes() == before
