"""The integrations import their library only when used; a missing one is a clear error."""

import importlib
import subprocess
import sys

import pytest

from msprobe.core.monitor_v2.errors import MissingDependencyError

CASES = [
    ("MonitorTrainerCallback", ["transformers"], "pip install transformers"),
    ("MonitorLightningCallback", ["lightning", "lightning.pytorch", "pytorch_lightning"], "pip install lightning"),
    ("AccelerateMonitor", ["accelerate"], "pip install accelerate"),
]


@pytest.mark.parametrize("name,blocked,hint", CASES)
def test_missing_library_names_what_to_install(monkeypatch, name, blocked, hint):
    for module in blocked:
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    for module in list(sys.modules):
        if module.startswith("msprobe.core.monitor_v2.integrations."):
            monkeypatch.delitem(sys.modules, module)
    integrations = importlib.import_module("msprobe.core.monitor_v2.integrations")
    with pytest.raises(MissingDependencyError, match=hint.replace(" ", r"\s")):
        getattr(integrations, name)


def test_importing_the_package_imports_no_framework():
    code = ("import sys, msprobe.core.monitor_v2.integrations as i, msprobe.core.monitor_v2.trainer; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unknown_name_is_an_attribute_error():
    import msprobe.core.monitor_v2.integrations as integrations

    with pytest.raises(AttributeError):
        integrations.NoSuchThing  # noqa: B018
