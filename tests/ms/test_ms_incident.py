"""MindSpore (PyNative): a config edited mid-run (``"dynamic": true``) turns ``module``
on for exactly the requested steps, and its Cell hooks are gone afterwards."""

import json

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import rows_of  # noqa: E402
from support.ms_helpers import MLP, batches, ms, nn  # noqa: E402

from msprobe.core.monitor_v2.analysis.control import ControlEdit, control  # noqa: E402
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402


def hooks_of(net):
    return {name: tuple(len(getattr(cell, d, None) or {}) for d in
                        ("_forward_pre_hook", "_forward_hook", "_backward_hook", "_backward_pre_hook"))
            for name, cell in net.cells_and_names()}


def test_dynamic_edit_turns_module_on_for_the_requested_steps(tmp_path):
    cfg = tmp_path / "monitor_config.json"
    cfg.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "dynamic": True,
                               "monitors": {"param": {"enabled": True}, "module": {"enabled": False}}}))
    net = MLP()
    grad_fn = ms.value_and_grad(lambda x: net(x).sum(), None, net.trainable_params())
    before = hooks_of(net)
    mon = TrainerMonitorV2(str(cfg), fr="mindspore")
    opt = nn.SGD(net.trainable_params(), learning_rate=0.01)
    mon.start(model=net, optimizer=opt)
    for step, (x, _) in enumerate(batches(8)):
        if step == 2:
            control(str(cfg), ControlEdit(enable="module", targets=["fc2"], steps=2))
        if step == 4:
            assert hooks_of(net) != before  # module is on for steps 3 and 4
        _, grads = grad_fn(ms.Tensor(x))
        opt(grads)  # the patched optimizer ends the step
    assert hooks_of(net) == before  # module went off again at step 5
    mon.stop()
    module = rows_of(tmp_path / "out", "module")
    assert sorted({int(r["step"]) for r in module}) == [3, 4]
    assert {r["module_name"].split(".")[0] for r in module} == {"fc2"}
    assert sorted({int(r["step"]) for r in rows_of(tmp_path / "out", "param")}) == list(range(8))
