"""On a GPU, the hooks never synchronise with the host: forward and backward passes run
under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any hidden sync.

This needs CUDA; on a machine without a GPU it is skipped with that reason (the CPU has
no device to synchronise with). The device machine runs it via scripts/gpu_checks.sh.
"""

import copy

import pytest
import torch

from support import rows_of
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the CPU has no device to synchronise with")


class Block(torch.nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


@pytest.mark.parametrize("per_micro_batch", [True, False], ids=["per-micro-batch", "batched-at-pass-end"])
def test_hooks_do_not_synchronise(tmp_path, per_micro_batch):
    """``monitor_mbs_grad=false`` on plain torch reads each backward pass's gradients in one
    batch when the pass ends (an autograd engine callback): that read runs inside
    ``backward()`` too, under the same sync check."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(64, 8)).cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    cfg = {
        "output_dir": str(tmp_path / "out"),
        "monitors": {
            "module": {"enabled": True},
            "weight_grad": {"enabled": True, "monitor_mbs_grad": per_micro_batch},
            "optimizer": {"enabled": True},
            "param": {"enabled": True},
        },
    }
    mon = TrainerMonitorV2(cfg)
    mon.start(model=model, optimizer=opt, grad_acc_steps=2)
    weight_grad = next(m for m in mon.monitors if m.name == "weight_grad")
    assert weight_grad._batched is (not per_micro_batch)
    for step in range(3):
        for _ in range(2):
            x = torch.randn(16, 10, 64, device="cuda")
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = model(x).pow(2).mean()
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    mon.stop()
    assert mon.errors.count == 0
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert len(rows_of(mon.config.output_dir, "module")) > 0
    assert len(rows_of(mon.config.output_dir, "weight_grad")) > 0


def test_record_many_on_a_gpu_reads_groups_without_a_sync():
    """The reads at the optimizer step and the batched ``unreduced`` read reduce small
    tensors of one shape in groups (stats._grouped_vectors): one stack and a few
    reductions per group, all on the device. Under the sync check, then against NumPy."""
    import math

    from support import numpy_stats
    from msprobe.core.monitor_v2.frameworks.pytorch.stats import TorchStatsEngine
    from msprobe.core.monitor_v2.stats import StatPlan, merge_records

    g = torch.Generator().manual_seed(0)
    host = [torch.randn(64, 64, generator=g) for _ in range(40)] + [torch.randn(64, generator=g) for _ in range(40)]
    host += [torch.randn(64, generator=g).bfloat16() for _ in range(8)] + [torch.randn(1 << 17, generator=g)]
    host[3][1, 2] = math.nan
    host[50][:8] = 0.0
    tensors = [t.cuda() for t in host]
    plan = StatPlan.from_ops(["min", "max", "mean", "norm", "nans", "zeros"])
    keys = [(0, f"t{i}", "param", None) for i in range(len(tensors))]
    engine = TorchStatsEngine()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        records = engine.record_many(tensors, plan, keys)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.to_host(records)
    for t, rec in zip(host, records):
        stat = merge_records(0, [rec])[0].stat
        want = numpy_stats(t)
        assert stat.nans == want["nans"]
        assert stat.zeros == int((t.double().numpy() == 0).sum())
        for op in ("min", "max", "mean", "norm"):
            got = stat.value(op)
            assert (math.isnan(got) and math.isnan(want[op])) or math.isclose(got, want[op], rel_tol=1e-9,
                                                                             abs_tol=1e-12), (op, got, want[op])
