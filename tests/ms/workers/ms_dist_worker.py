"""Worker of tests/ms/test_ms_distributed.py, started by ``msrun`` with 2 workers
on the CPU: ``python ms_dist_worker.py <out_dir>``.

Step 0: explicit collectives (``mint.distributed`` all_reduce / all_gather / broadcast,
the ``ops.AllReduce`` primitive, and an ``async_op=True`` all_reduce whose buffer is
reused after ``wait()``), then one training step whose local gradients go
through ``nn.DistributedGradReducer(mean=True)`` before ``optimizer(grads)``. Step 1: one
more training step. Each rank trains on different data.

Saved in ``<out_dir>/rank<r>.npz``: copies of every tensor each collective was given
(before the call) and produced (after it), the local gradients and the gradients passed
to the optimizer; ``<out_dir>/rank<r>.json``: the call lines and whether the patched
functions were replaced during the run and are the originals again after ``stop()``.
Lines of the calls are found by the markers ``# <cc:NAME>``.
"""

import json
import os
import sys

import numpy as np

import mindspore as ms  # noqa: E402
import mindspore.communication.comm_func as comm_func  # noqa: E402
import mindspore.mint.distributed as md  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402
from mindspore.communication import get_group_size, get_rank, init  # noqa: E402

from support.ms_helpers import MLP, batches, grads_np, mse  # noqa: E402  (sets PYNATIVE_MODE and the CPU)

ms.set_context(mode=ms.PYNATIVE_MODE)
init()

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

out = sys.argv[1]
rank, world = get_rank(), get_group_size()
assert world == 2, world
PRIMITIVES = ("AllReduce", "AllGather", "Broadcast", "ReduceScatter", "AlltoAll", "Send", "Receive")
MINT_NAMES = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
              "reduce", "send", "recv", "isend", "irecv", "all_to_all", "all_to_all_single")
mint_modules = {"mint.distributed": md, "mint.distributed.distributed": sys.modules["mindspore.mint.distributed.distributed"]}


def snapshot():
    funcs = {f"{m}.{n}": getattr(mod, n) for m, mod in mint_modules.items() for n in MINT_NAMES if hasattr(mod, n)}
    funcs.update({f"comm_func.{n}": getattr(comm_func, n) for n in ("all_reduce", "broadcast", "all_gather_into_tensor")
                  if hasattr(comm_func, n)})
    own_call = {n: "__call__" in vars(getattr(ops, n)) for n in PRIMITIVES if hasattr(ops, n)}
    return funcs, own_call


orig_funcs, orig_own_call = snapshot()
saved = {}
lines = {}


def line_of(marker):
    with open(__file__, encoding="utf-8") as f:
        src = f.read().splitlines()
    hits = [i + 1 for i, ln in enumerate(src) if ln.rstrip().endswith(f"# <cc:{marker}>")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


net = MLP(d_hidden=5)
opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
reducer = nn.DistributedGradReducer(opt.parameters, mean=True)
grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
data = batches(2, seed=100 + rank)  # different data on each rank

mon = TrainerMonitorV2({"output_dir": out, "monitors": {
    "weight_grad": {"enabled": True, "monitor_mbs_grad": True},
    "cc": {"enabled": True, "cc_pre_hook": True}}}, fr="mindspore")
mon.start(model=net, optimizer=opt, grad_acc_steps=1)
during_funcs, during_own_call = snapshot()

# ---------------------------------------------------------------- step 0: collectives
t = Tensor(np.arange(4, dtype=np.float32) * (rank + 1) - 1.5)
saved["all_reduce.pre.0"] = t.asnumpy().copy()
md.all_reduce(t)  # <cc:all_reduce>
saved["all_reduce.post.0"] = t.asnumpy().copy()

g_in = Tensor(np.array([[1.0, -2.0, 0.5], [3.0, 4.0, -1.0]], np.float32) * (rank + 2))
g_out = [Tensor(np.zeros((2, 3), np.float32)) for _ in range(world)]
saved["all_gather.pre.0"] = g_in.asnumpy().copy()
md.all_gather(g_out, g_in)  # <cc:all_gather>
for i, o in enumerate(g_out):
    saved[f"all_gather.post.{i}"] = o.asnumpy().copy()

b = Tensor(np.linspace(-1, 1, 5).astype(np.float32) + 10 * rank)
saved["broadcast.pre.0"] = b.asnumpy().copy()
md.broadcast(b, src=0)  # <cc:broadcast>
saved["broadcast.post.0"] = b.asnumpy().copy()

prim = ops.AllReduce()
p_in = Tensor(np.array([0.25, -0.5, 2.0], np.float32) * (rank - 3))
saved["AllReduce.pre.0"] = p_in.asnumpy().copy()
p_out = prim(p_in)  # <cc:AllReduce>
saved["AllReduce.post.0"] = p_out.asnumpy().copy()

# asynchronous: the result is ready at wait(); the buffer is then reused (zeroed in
# place) before the step ends, so a row read at the end of the step would be wrong
a_buf = Tensor(np.array([1.0, -2.0, 4.0], np.float32) * (rank + 1))
saved["all_reduce_async.pre.0"] = a_buf.asnumpy().copy()
work = md.all_reduce(a_buf, async_op=True)  # <cc:all_reduce_async>
work.wait()
saved["all_reduce_async.post.0"] = a_buf.asnumpy().copy()
a_buf[:] = 0
assert not a_buf.asnumpy().any()

# ------------------------------------------------- steps 0 and 1: data-parallel training
for step, (x, y) in enumerate(data):
    loss, grads = grad_fn(Tensor(x), Tensor(y))
    for p, g in zip(opt.parameters, grads_np(grads)):
        saved[f"local.{step}.{p.name}"] = g
    reduced = reducer(grads)  # <cc:reducer>
    for p, g in zip(opt.parameters, grads_np(reduced)):
        saved[f"passed.{step}.{p.name}"] = g
    opt(reduced)  # ends the monitor's step (optimizer patched)

mon.stop()
after_funcs, after_own_call = snapshot()

report = {
    "rank": rank,
    "lines": {m: line_of(m) for m in ("all_reduce", "all_gather", "broadcast", "AllReduce", "all_reduce_async",
                                      "reducer")},
    "param_names": [p.name for p in opt.parameters],
    "patched_during": sorted(k for k in orig_funcs if during_funcs[k] is not orig_funcs[k]),
    "own_call_during": sorted(k for k, v in during_own_call.items() if v),
    "not_restored": sorted(k for k in orig_funcs if after_funcs[k] is not orig_funcs[k]),
    "own_call_before": sorted(k for k, v in orig_own_call.items() if v),
    "own_call_after": sorted(k for k, v in after_own_call.items() if v),
    "errors_contained": mon.errors.count,
}
np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
print(f"rank {rank} done", flush=True)
