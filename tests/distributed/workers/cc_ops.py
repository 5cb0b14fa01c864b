"""Worker for tests/distributed/test_cc.py, run by torchrun with 2 gloo ranks (CPU).

    cc_ops.py MODE OUT_DIR

MODE:
- ``ops``: every collective and point-to-point op gloo supports, sync and async,
  with ``cc_pre_hook`` and ``start_step: 1`` (step 0 is outside the schedule).
- ``features``: ``cc_codeline``, ``cc_log_only`` and ``module_ranks``, one monitor
  session after the other, each in its own sub-directory of OUT_DIR.
- ``ddp``: DDP with ``enable_ddp_comm_visibility`` under the cc monitor, against DDP
  without hook and without monitor.

Every monitored call goes through ``rec``/``begin``+``end`` written on the same line as
the call itself: they note the caller's line (the call site the tag must name), clone
the input tensors before the call and the result tensors after it. The references go
to ``<OUT_DIR>/<mode>_rank<r>.pt``; the test compares the CSV rows with them.

Each session also checks that ``stop()`` put back every function object of
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (identity).
"""

import copy
import datetime
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from msprobe.core.monitor_v2.frameworks.pytorch import enable_ddp_comm_visibility
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

warnings.simplefilter("ignore", FutureWarning)  # the deprecated 2.13 names

NAMESPACES = (dist, c10d)
STEP = 0
CALLS = []  # one dict per monitored call: step, op, line, pre (list), post (list)
_counter = [0]


# ----------------------------------------------------------------------- helpers
def val(n):
    """A fresh tensor of ``n`` values, different on every call, step and rank."""
    _counter[0] += 1
    g = torch.Generator().manual_seed(1000 * STEP + 10 * _counter[0] + dist.get_rank())
    return torch.randn(n, generator=g) * (dist.get_rank() + 1) + dist.get_rank()


def rec(op, ins, fn, outs, wait=False):
    """Call ``fn`` (a lambda on the caller's line), noting inputs before and results after."""
    entry = {"step": STEP, "op": op, "line": sys._getframe(1).f_lineno, "pre": [t.clone() for t in ins]}
    result = fn()
    if wait:
        for work in result if isinstance(result, list) else [result]:
            work.wait()
    entry["post"] = [t.clone() for t in outs]
    CALLS.append(entry)
    return result


def begin(op, ins):
    """For calls whose completion is awaited later: note the caller's line and the inputs."""
    return {"step": STEP, "op": op, "line": sys._getframe(1).f_lineno, "pre": [t.clone() for t in ins]}


def end(entry, outs):
    entry["post"] = [t.clone() for t in outs]
    CALLS.append(entry)


def rank_delay(seconds=0.05):
    """Rank 1 joins late, so that rank 0's async op cannot be complete when it returns."""
    if dist.get_rank() == 1:
        time.sleep(seconds)


def snapshot():
    out = {}
    for mod in NAMESPACES:
        for name in dir(mod):
            obj = getattr(mod, name, None)
            if callable(obj):
                out[(mod.__name__, name)] = obj
    return out


def not_restored(before):
    return sorted(f"{m}.{n}" for (m, n), obj in before.items() if getattr(sys.modules[m], n, None) is not obj)


def line_of(marker):
    """Line number of the line of this file that ends with the comment ``# <marker>``."""
    with open(__file__, encoding="utf-8") as f:
        hits = [i for i, text in enumerate(f, 1) if text.rstrip().endswith("# " + marker)]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


def session(cfg, body):
    """Run ``body`` under a monitor; return what the test needs about the session."""
    before = snapshot()
    mon = TrainerMonitorV2(cfg)
    mon.start()
    patched = dist.all_reduce is not before[("torch.distributed", "all_reduce")] and \
        c10d.all_gather_single is not before[("torch.distributed.distributed_c10d", "all_gather_single")]
    body(mon)
    mon.stop()
    return {"patched_while_running": patched, "not_restored_after_stop": not_restored(before),
            "contained_errors": mon.errors.count}


def cc_config(out_dir, **cc):
    return {"output_dir": out_dir, "monitors": {"module": {"enabled": False}, "cc": {"enabled": True, **cc}}}


# ---------------------------------------------------------------------- mode ops
def all_ops():
    """Every op gloo supports, with different values per rank; results are checked."""
    W, r = dist.get_world_size(), dist.get_rank()
    p = 1 - r
    info = {}
    # all_reduce: sync, async (rank 0 must get its work back before the result exists), c10d namespace
    t = val(5); rec("all_reduce", [t], lambda: dist.all_reduce(t), [t])
    t = val(5); rank_delay(0.5); e = begin("all_reduce", [t]); w = dist.all_reduce(t, async_op=True)
    info["async_returned_before_done"] = not w.is_completed()
    w.wait(); end(e, [t])
    t = val(4); rec("all_reduce", [t], lambda: c10d.all_reduce(t), [t])
    # all_gather (list)
    t = val(3); o = [torch.zeros(3) for _ in range(W)]; rec("all_gather", [t], lambda: dist.all_gather(o, t), o)
    t = val(3); o = [torch.zeros(3) for _ in range(W)]; rank_delay(); rec("all_gather", [t], lambda: dist.all_gather(o, t, async_op=True), o, wait=True)
    # all_gather_into_tensor (deprecated, forwards to all_gather_single) and all_gather_single
    t = val(3); o = torch.zeros(3 * W); rec("all_gather_into_tensor", [t], lambda: dist.all_gather_into_tensor(o, t), [o])
    t = val(3); o = torch.zeros(3 * W); rank_delay(); rec("all_gather_into_tensor", [t], lambda: dist.all_gather_into_tensor(o, t, async_op=True), [o], wait=True)
    t = val(3); o = torch.zeros(3 * W); rec("all_gather_single", [t], lambda: dist.all_gather_single(o, t), [o])
    t = val(3); o = torch.zeros(3 * W); rank_delay(); rec("all_gather_single", [t], lambda: dist.all_gather_single(o, t, async_op=True), [o], wait=True)
    # reduce_scatter (list)
    i = [val(2) for _ in range(W)]; o = torch.zeros(2); rec("reduce_scatter", i, lambda: dist.reduce_scatter(o, i), [o])
    i = [val(2) for _ in range(W)]; o = torch.zeros(2); rank_delay(); rec("reduce_scatter", i, lambda: dist.reduce_scatter(o, i, async_op=True), [o], wait=True)
    # reduce_scatter_tensor (deprecated, forwards to reduce_scatter_single) and reduce_scatter_single
    t = val(2 * W); o = torch.zeros(2); rec("reduce_scatter_tensor", [t], lambda: dist.reduce_scatter_tensor(o, t), [o])
    t = val(2 * W); o = torch.zeros(2); rank_delay(); rec("reduce_scatter_tensor", [t], lambda: dist.reduce_scatter_tensor(o, t, async_op=True), [o], wait=True)
    t = val(2 * W); o = torch.zeros(2); rec("reduce_scatter_single", [t], lambda: dist.reduce_scatter_single(o, t), [o])
    t = val(2 * W); o = torch.zeros(2); rank_delay(); rec("reduce_scatter_single", [t], lambda: dist.reduce_scatter_single(o, t, async_op=True), [o], wait=True)
    # broadcast (from rank 1)
    t = val(4); rec("broadcast", [t], lambda: dist.broadcast(t, src=1), [t])
    t = val(4); rank_delay(); rec("broadcast", [t], lambda: dist.broadcast(t, src=1, async_op=True), [t], wait=True)
    # reduce (to rank 0)
    t = val(4); rec("reduce", [t], lambda: dist.reduce(t, dst=0), [t])
    t = val(4); rank_delay(); rec("reduce", [t], lambda: dist.reduce(t, dst=0, async_op=True), [t], wait=True)
    # gather (to rank 0): rank 1 has no gather_list, hence no post tensor
    t = val(3); gl = [torch.zeros(3) for _ in range(W)] if r == 0 else None; rec("gather", [t], lambda: dist.gather(t, gl, dst=0), gl or [])
    t = val(3); gl = [torch.zeros(3) for _ in range(W)] if r == 0 else None; rank_delay(); rec("gather", [t], lambda: dist.gather(t, gl, dst=0, async_op=True), gl or [], wait=True)
    # scatter (from rank 1): rank 0 has no scatter_list, hence no pre tensor
    sl = [val(3) for _ in range(W)] if r == 1 else None; o = torch.zeros(3); rec("scatter", sl or [], lambda: dist.scatter(o, sl, src=1), [o])
    sl = [val(3) for _ in range(W)] if r == 1 else None; o = torch.zeros(3); rank_delay(); rec("scatter", sl or [], lambda: dist.scatter(o, sl, src=1, async_op=True), [o], wait=True)
    # all_to_all (list) and all_to_all_single
    i = [val(2) for _ in range(W)]; o = [torch.zeros(2) for _ in range(W)]; rec("all_to_all", i, lambda: dist.all_to_all(o, i), o)
    i = [val(2) for _ in range(W)]; o = [torch.zeros(2) for _ in range(W)]; rank_delay(); rec("all_to_all", i, lambda: dist.all_to_all(o, i, async_op=True), o, wait=True)
    t = val(2 * W); o = torch.zeros(2 * W); rec("all_to_all_single", [t], lambda: dist.all_to_all_single(o, t), [o])
    t = val(2 * W); o = torch.zeros(2 * W); rank_delay(); rec("all_to_all_single", [t], lambda: dist.all_to_all_single(o, t, async_op=True), [o], wait=True)
    # send / recv (each rank sends once and receives once)
    if r == 0:
        t = val(3); rec("send", [t], lambda: dist.send(t, dst=1), [t])
        t = torch.zeros(3); rec("recv", [], lambda: dist.recv(t, src=1), [t])
    else:
        t = torch.zeros(3); rec("recv", [], lambda: dist.recv(t, src=0), [t])
        t = val(3); rec("send", [t], lambda: dist.send(t, dst=0), [t])
    # isend / irecv, awaited after both are posted
    s = val(3); rb = torch.zeros(3); rank_delay()
    e1 = begin("isend", [s]); w1 = dist.isend(s, dst=p)
    e2 = begin("irecv", []); w2 = dist.irecv(rb, src=p)
    w1.wait(); w2.wait(); end(e1, [s]); end(e2, [rb])
    # batch_isend_irecv: pre = the tensors sent, post = every tensor of the list in order
    s = val(4); rb = torch.zeros(4); ops = [dist.P2POp(dist.isend, s, p), dist.P2POp(dist.irecv, rb, p)]
    rank_delay(); rec("batch_isend_irecv", [s], lambda: dist.batch_isend_irecv(ops), [s, rb], wait=True)
    # aggregation: one line called 3 times in a step (different sizes), merged into one row per tag
    for n in (3, 5, 8):
        t = val(n); rec("all_reduce", [t], lambda: dist.all_reduce(t), [t])
    # NaN counts are summed over the calls of one tag
    for k in range(2):
        t = val(4); t[2 * k] = float("nan"); rec("all_reduce", [t], lambda: dist.all_reduce(t), [t])
    return info


def mode_ops(out_dir):
    global STEP
    infos = []

    # P2POps made before start() hold the original isend/irecv; batch_isend_irecv tells
    # sends from receives by identity, so the monitor must keep them working.
    peer = 1 - dist.get_rank()
    early_send, early_recv = torch.full((2,), float(dist.get_rank() + 7)), torch.zeros(2)
    early_ops = [dist.P2POp(dist.isend, early_send, peer), dist.P2POp(dist.irecv, early_recv, peer)]

    def body(mon):
        global STEP
        for step in (0, 1):  # start_step 1: step 0 is not written
            STEP = step
            infos.append(all_ops())
            mon.step()
        for work in dist.batch_isend_irecv(early_ops):
            work.wait()
        assert early_recv.tolist() == [float(peer + 7)] * 2, early_recv

    cfg = cc_config(os.path.join(out_dir, "ops"), cc_pre_hook=True)
    cfg["start_step"] = 1
    result = session(cfg, body)
    # with the monitor stopped, the same ops still work (nothing recorded, nothing broken)
    STEP = 2
    all_ops()
    result.update(calls=[c for c in CALLS if c["step"] < 2], infos=infos)
    return result


# ----------------------------------------------------------------- mode features
def helper_all_reduce():
    t = val(3); rec("all_reduce", [t], lambda: dist.all_reduce(t), [t])  # cc-helper-inner


def codeline_calls():
    t = val(4); rec("all_reduce", [t], lambda: dist.all_reduce(t), [t])  # cc-codeline-keep
    t = val(4); rec("all_reduce", [t], lambda: dist.all_reduce(t), [t])  # cc-codeline-dropped
    t = val(2); rec("broadcast", [t], lambda: dist.broadcast(t, src=0), [t])  # cc-codeline-dropped-op
    helper_all_reduce()  # cc-codeline-outer
    helper_all_reduce()  # cc-codeline-outer-dropped


def tiny_training(steps, mon=None):
    """A small data-parallel training loop whose collectives are made by hand."""
    W = dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    losses = []
    for _ in range(steps):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for prm in model.parameters():
            rec("all_reduce", [prm.grad], lambda: dist.all_reduce(prm.grad), [prm.grad])  # cc-log-all_reduce
            prm.grad /= W
        t = loss.detach().reshape(1).clone(); rec("broadcast", [t], lambda: dist.broadcast(t, src=0), [t])  # cc-log-broadcast
        o = [torch.zeros(1) for _ in range(W)]; rec("all_gather", [t], lambda: dist.all_gather(o, t), o)  # cc-log-all_gather
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        if mon is not None:
            mon.step()
    return torch.stack(losses), [prm.detach().clone() for prm in model.parameters()]


def mode_features(out_dir):
    global STEP
    res = {}
    lines = {m: line_of(m) for m in ("cc-codeline-keep", "cc-codeline-dropped", "cc-codeline-dropped-op", "cc-helper-inner",
                                    "cc-codeline-outer", "cc-codeline-outer-dropped", "cc-log-all_reduce",
                                    "cc-log-broadcast", "cc-log-all_gather")}
    res["lines"] = lines

    # cc_codeline: the direct line, and an outer line of the stack (the helper's call site)
    CALLS.clear()
    codelines = [f"cc_ops.py[{lines['cc-codeline-keep']}]", f"cc_ops.py[{lines['cc-codeline-outer']}]"]
    marks = []

    def codeline_body(mon):
        global STEP
        for step in (0, 1):
            STEP = step
            marks.append(len(CALLS))
            codeline_calls()
            mon.step()

    res["codeline"] = session(cc_config(os.path.join(out_dir, "codeline"), cc_codeline=codelines), codeline_body)
    res["codeline"]["calls"] = list(CALLS)

    # cc_log_only: a 3-step training, compared with the same training without monitor
    STEP = 0
    CALLS.clear()
    ref_losses, ref_params = tiny_training(3)
    got = {}

    def log_body(mon):
        got["losses"], got["params"] = tiny_training(3, mon)

    res["log_only"] = session(cc_config(os.path.join(out_dir, "log_only"), cc_log_only=True, cc_pre_hook=True), log_body)
    res["log_only"]["bit_identical"] = torch.equal(ref_losses, got["losses"]) and all(
        torch.equal(a, b) for a, b in zip(ref_params, got["params"]))
    res["log_only"]["steps_done"] = len(got["losses"])

    # module_ranks [1]
    CALLS.clear()

    def ranks_body(mon):
        global STEP
        for step in (0, 1):
            STEP = step
            t = val(4); rec("all_reduce", [t], lambda: dist.all_reduce(t), [t])
            mon.step()

    res["module_ranks"] = session(cc_config(os.path.join(out_dir, "module_ranks"), module_ranks=[1]), ranks_body)
    res["module_ranks"]["calls"] = list(CALLS)
    return res


# ----------------------------------------------------------------------- mode ddp
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


DDP_STEPS = 3


def ddp_train(out_dir, monitored):
    torch.manual_seed(0)
    base = Net()
    plain = copy.deepcopy(base)
    model = torch.nn.parallel.DistributedDataParallel(base)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    data = [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(DDP_STEPS)]
    losses, local, reduced = [], [], []

    def body(mon):
        for x, y in data:
            if monitored:  # this rank's own gradient, from an unmonitored plain copy
                with torch.no_grad():
                    for a, b in zip(plain.parameters(), model.module.parameters()):
                        a.copy_(b)
                grads = torch.autograd.grad(torch.nn.functional.mse_loss(plain(x), y), list(plain.parameters()))
                local.append(torch.cat([gr.reshape(-1) for gr in grads]))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()  # cc-ddp-backward
            reduced.append(torch.cat([prm.grad.reshape(-1) for prm in model.parameters()]))
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
            if mon is not None:
                mon.step()

    result = {}
    if monitored:
        enable_ddp_comm_visibility(model)
        result = session(cc_config(os.path.join(out_dir, "ddp"), cc_pre_hook=True), body)
    else:
        body(None)
    result.update(losses=torch.stack(losses), params=[prm.detach().clone() for prm in model.parameters()],
                  local=local, reduced=reduced)
    return result


def mode_ddp(out_dir):
    plain = ddp_train(out_dir, monitored=False)
    mon = ddp_train(out_dir, monitored=True)
    mon["bit_identical"] = torch.equal(plain["losses"], mon["losses"]) and all(
        torch.equal(a, b) for a, b in zip(plain["params"], mon["params"]))
    mon["backward_line"] = line_of("cc-ddp-backward")
    return mon


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    result = {"ops": mode_ops, "features": mode_features, "ddp": mode_ddp}[mode](out_dir)
    torch.save(result, os.path.join(out_dir, f"{mode}_rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from support import finish

    finish()
