"""The new-user scenario of the incident page (docs/incident.md): a 6-layer model whose
``blocks.2.fc.weight`` gets a NaN written into it before step ``NAN_STEP``, trained with
the always-on config (``weight_grad`` only), with ``step_interval`` 5, and with
``module`` (every layer), ``param`` and ``alert`` on; and ``transient``: ``step_interval``
5 with ``param`` on, where the NaN comes from ``blocks.2.fc``'s output in step
``TRANSIENT_STEP`` alone (a forward hook), so that the parameters of that step are clean.

Run as a script (``python tests/analysis/incident_runs.py OUT``) it writes the three
runs under ``OUT/`` (``always_on``, ``interval``, ``module``), as the page shows them.
"""

import sys
from pathlib import Path
from typing import Any, Dict

import torch

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

STEPS = 25
NAN_STEP = 17
TRANSIENT_STEP = 20
BAD_LAYER = "blocks.2.fc"
N_BLOCKS = 6
D = 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class SixLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def config(name: str, out: Path) -> Dict[str, Any]:
    """The config of run ``name``: ``always_on``, ``interval`` or ``module``."""
    cfg: Dict[str, Any] = {"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}}}
    if name == "interval":
        cfg["step_interval"] = 5
    elif name == "transient":
        cfg["step_interval"] = 5
        cfg["monitors"]["param"] = {"enabled": True}
    elif name == "module":
        cfg["monitors"].update(module={"enabled": True}, param={"enabled": True})
        cfg["alert"] = True
    return cfg


def train(name: str, out: Path) -> Path:
    torch.manual_seed(0)
    model = SixLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(config(name, out))
    mon.start(model=model, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    current = [0]
    if name == "transient":
        def poison(_module, _inputs, output):
            return output * float("nan") if current[0] == TRANSIENT_STEP else output

        model.blocks[2].fc.register_forward_hook(poison)
    for step in range(STEPS):
        current[0] = step
        # a corrupted weight, as a bad checkpoint shard or a faulty kernel would leave it
        if step == NAN_STEP and name != "transient":
            with torch.no_grad():
                model.blocks[2].fc.weight[0, 0] = float("nan")
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    return out


RUNS = ("always_on", "interval", "module", "transient")

if __name__ == "__main__":
    root = Path(sys.argv[1])
    for run in RUNS:
        train(run, root / run)
