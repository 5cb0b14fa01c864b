"""module monitor: forward inputs/outputs and backward gradients of modules, on a tiny
GPT-like transformer with the awkward parts of real models (tied weights, in-place ReLU
and residual adds, activation checkpointing, a shared module, keyword arguments,
dict/dataclass/tuple outputs with non-tensors, a frozen module) and on a Hugging Face
GPT-2 built from a config.

Every expected value is computed independently on an unmonitored copy of the model:
forward values with plain forward hooks that clone what they see, gradients with
``torch.autograd.grad`` (with respect to the gradient edges of the module outputs as
they were when the module returned, and with respect to private clones of the inputs
that each module call receives), cross-checked against ``register_full_backward_hook``
on a variant without in-place ops. Statistics are taken with NumPy in fp64.
"""

import copy
import dataclasses
import gc
import logging
import math
import weakref
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.extras import needs
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

V, T, D, N_HEAD, B = 50, 8, 16, 2, 2
LOGGER = "msprobe.monitor_v2"
KINDS = ("input", "output", "grad_input", "grad_output")


# --------------------------------------------------------------------------- model
@dataclasses.dataclass
class LMOutput:
    loss: Optional[torch.Tensor]
    n_tokens: int  # a non-tensor between two tensors: skipped, does not take an index
    logits: torch.Tensor


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:  # mask: keyword only
        b, t, c = x.shape
        hd = c // self.n_head
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(~mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d: int, inplace: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.ReLU(inplace=inplace)  # modifies fc's output in place
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_head)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d, inplace)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.ln1(x), mask=mask)
        if self.inplace:
            h += x  # in place on attn's output (not a leaf)
        else:
            h = h + x
        out = self.mlp(self.ln2(h))
        if self.inplace:
            out += h  # in place on mlp's output
        else:
            out = out + h
        return out


class Split(nn.Module):
    """Returns a tuple with an int between the tensors."""

    def forward(self, x: torch.Tensor):
        a, b = x.chunk(2, dim=-1)
        return a * 2, 7, torch.tanh(b)


class Mixer(nn.Module):
    """Returns a dict with an int between the tensors."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d // 2, d)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Dict[str, Any]:
        return {"h": torch.cat([a, b], dim=-1), "n": 3, "gate": self.gate(b)}


class Head(nn.Module):
    """Returns a dataclass; ``targets`` comes as a keyword argument."""

    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, h: torch.Tensor, targets: Optional[torch.Tensor] = None) -> LMOutput:
        logits = self.lm_head(h)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return LMOutput(loss=loss, n_tokens=h.shape[0] * h.shape[1], logits=logits)


class TinyGPT(nn.Module):
    def __init__(self, ckpt: Optional[str] = "nonreentrant", inplace: bool = True, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.ckpt = ckpt  # None, "nonreentrant" or "reentrant": how blocks.1 runs
            self.tok_emb = nn.Embedding(V, D)
            self.pos_emb = nn.Embedding(T, D)
            self.pos_emb.weight.requires_grad_(False)  # frozen: its output needs no grad
            self.blocks = nn.ModuleList([Block(D, N_HEAD, inplace) for _ in range(2)])
            self.shared = nn.Linear(D, D)  # called twice per forward
            self.split = Split()
            self.mixer = Mixer(D)
            self.ln_f = nn.LayerNorm(D)
            self.head = Head(D, V)
            self.head.lm_head.weight = self.tok_emb.weight  # tied
            with torch.no_grad():  # non-trivial LayerNorm affine parameters
                for name, p in self.named_parameters():
                    if "ln" in name:
                        p.add_(torch.randn_like(p) * 0.1)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> LMOutput:
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t))  # embeddings: inputs need no grad
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        for i, blk in enumerate(self.blocks):
            if i == 1 and self.ckpt:
                x = checkpoint(blk, x, mask, use_reentrant=self.ckpt == "reentrant")
            else:
                x = blk(x, mask)
        x = x + self.shared(x)
        x = x + self.shared(torch.tanh(x))
        a, _, b = self.split(x)
        m = self.mixer(a, b)
        h = self.ln_f(m["h"] * torch.sigmoid(m["gate"]))
        return self.head(h, targets=targets)


ROOT = "TinyGPT"
NAMES = [
    ROOT, "tok_emb", "pos_emb",
    *[f"blocks.{i}{s}" for i in range(2) for s in (
        "", ".ln1", ".attn", ".attn.qkv", ".attn.proj", ".ln2", ".mlp", ".mlp.fc", ".mlp.act", ".mlp.out")],
    "shared", "split", "mixer", "mixer.gate", "ln_f", "head", "head.lm_head",
]  # every module that runs ("blocks", a ModuleList, is never called)


def make_data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(n)]


def fresh_copy(model: TinyGPT, ckpt: Optional[str] = None, inplace: Optional[bool] = None) -> TinyGPT:
    """Unmonitored copy with the same weights (a deepcopy of a monitored model would copy its hooks)."""
    ref = TinyGPT(ckpt=ckpt, inplace=model.blocks[0].inplace if inplace is None else inplace)
    ref.load_state_dict(model.state_dict())
    ref.train(model.training)
    return ref


# ----------------------------------------------------------------------- reference
def _flat(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _flat(getattr(obj, f.name))]
    return []


def _named(obj: Any, prefix: str = "") -> List[Tuple[str, torch.Tensor]]:
    """The contract's output names: entries of a dict by key (recursively), everything
    else numbered over its tensors (a dict inside a tuple with the rest of the tuple)."""
    if isinstance(obj, dict):
        out = []
        for key, value in obj.items():
            out += [(f"{prefix}.{key}", value)] if isinstance(value, torch.Tensor) else _named(value, f"{prefix}.{key}")
        return out
    return [(f"{prefix}.{i}", t) for i, t in enumerate(_flat(obj))]


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Same traversal order as ``_flat``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
    return obj


def expected(model: TinyGPT, batches, loss_scale: float = 1.0) -> Dict[str, List[torch.Tensor]]:
    """Expected tensors per tag: forward values from an unmonitored copy of ``model`` (with
    its in-place ops), gradients from an unmonitored copy without in-place ops (the same
    values; there every output's gradient edge stays in the graph). No checkpointing."""
    fwd = _reference(fresh_copy(model), batches, grads=False)
    bwd = _reference(fresh_copy(model, inplace=False), batches, loss_scale=loss_scale)
    for tag in fwd:  # the variant computes the same forward values
        assert len(fwd[tag]) == len(bwd[tag]) and all(torch.equal(a, b) for a, b in zip(fwd[tag], bwd[tag])), tag
    return dict(fwd, **{tag: ts for tag, ts in bwd.items() if ".grad_" in tag})


def _reference(model: nn.Module, batches, loss_scale: float = 1.0, grads: bool = True,
               root: str = ROOT) -> Dict[str, List[torch.Tensor]]:
    """Expected tensors per tag over all module calls of ``batches`` (micro-batches of one
    step) on an unmonitored model.

    Forward: clones taken by plain forward pre-hooks / forward hooks.
    grad_output: ``torch.autograd.grad`` w.r.t. the gradient edge of each output as it was
    when the module returned (the total derivative w.r.t. that tensor; valid as long as no
    in-place op later rebases a view output); the loss is multiplied by ``loss_scale``
    first, as the training loop does.
    grad_input: each module call receives a private clone ``r.clone()`` of each input that
    needs grad; ``torch.autograd.grad`` w.r.t. ``r`` is the gradient this call sends to it.
    """
    exp = defaultdict(list)
    for idx, tgt in batches:
        wrt: List = []  # (tag, tensor or gradient edge)
        handles = []
        for name, mod in model.named_modules():
            tag = name or root

            def pre(m, args, kwargs, tag=tag):
                counter = iter(range(1 << 30))

                def rep(t):
                    i = next(counter)
                    exp[f"{tag}.input.{i}"].append(t.detach().clone())
                    if not (grads and torch.is_grad_enabled() and t.requires_grad):
                        return t
                    r = t.clone()
                    wrt.append((f"{tag}.grad_input.{i}", r))
                    return r.clone()

                return _map((args, kwargs), rep)

            def post(m, args, kwargs, out, tag=tag):
                for suffix, t in _named(out):
                    exp[f"{tag}.output{suffix}"].append(t.detach().clone())
                    if grads and t.requires_grad and t.grad_fn is not None:
                        wrt.append((f"{tag}.grad_output{suffix}", torch.autograd.graph.get_gradient_edge(t)))

            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post, with_kwargs=True))
        try:
            out = model(idx, targets=tgt)
        finally:
            for h in handles:
                h.remove()
        if grads and torch.is_grad_enabled():
            got = torch.autograd.grad(out.loss * loss_scale, [w for _, w in wrt], allow_unused=True)
            for (tag, _), g in zip(wrt, got):
                if g is not None:
                    exp[tag].append(g)
    return exp


def stats_of(tensors: List[torch.Tensor]) -> Dict[str, float]:
    """NumPy stats of several calls together (concatenated)."""
    return numpy_stats(torch.cat([t.detach().reshape(-1) for t in tensors]))


def check(row: Dict[str, str], tensors: List[torch.Tensor]) -> None:
    want = stats_of(tensors)
    scale = max(abs(want["min"]), abs(want["max"]), 1e-30)
    assert_row_matches(row, want, rtol=1e-4, atol=1e-6 * scale)


def tag_of(row) -> str:
    return row["module_name"]


def module_of(tag: str) -> str:
    for kind in KINDS:
        marker = f".{kind}."
        if marker in tag:
            return tag[: tag.rindex(marker)]
    raise AssertionError(f"not a module tag: {tag}")


def cfg(tmp_path, **module) -> Dict[str, Any]:
    return {"output_dir": str(tmp_path / "out"), "monitors": {"module": {"enabled": True, **module}}}


@pytest.fixture
def no_monitor_errors(caplog):
    """Fails the test if the monitor logged (contained) an error."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    yield caplog
    errors = [r for r in caplog.records if r.name.startswith(LOGGER) and r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def run_monitored(model, steps_batches, config, optimizer=None, **start_kwargs):
    """One list of micro-batches per step; returns (monitor, losses)."""
    mon = TrainerMonitorV2(config)
    mon.start(model=model, optimizer=optimizer, **start_kwargs)
    losses = []
    try:
        for micro in steps_batches:
            for idx, tgt in micro:
                loss = model(idx, targets=tgt).loss
                (loss / len(micro)).backward()
                losses.append(loss.detach().clone())
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
            else:
                mon.step()
    finally:
        mon.stop()
    assert mon.errors.count == 0
    return mon, losses


def assert_rows_match_reference(rows, exp, step: int, check_missing: bool = True,
                                forward_scope: str = "forward") -> None:
    got = {tag_of(r): r for r in rows if r["step"] == str(step)}
    per_step = [r for r in rows if r["step"] == str(step)]
    assert len(per_step) == len(got), "one row per tag and step"
    wrong = []
    for tag, tensors in exp.items():
        if tag not in got:
            continue
        row = got[tag]
        try:
            assert row["scope"] == (forward_scope if ".input." in tag or ".output." in tag else "backward"), row
            assert row["vpp_stage"] == "0"
            check(row, tensors)
        except AssertionError as exc:
            wrong.append(f"{tag}: {exc}")
    assert not wrong, wrong
    assert not (set(got) - set(exp)), f"extra rows: {sorted(set(got) - set(exp))}"
    if check_missing:
        assert set(got) == set(exp), f"missing rows: {sorted(set(exp) - set(got))}, extra rows: {sorted(set(got) - set(exp))}"


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
def test_all_values_match_independent_computation(tmp_path, ckpt, no_monitor_errors):
    """Tests 1 and 2: every forward and backward row of one step equals the reference."""
    model = TinyGPT(ckpt=ckpt)
    data = make_data(1)
    exp = expected(model, data)
    mon, _ = run_monitored(model, [data], cfg(tmp_path))
    rows = rows_of(tmp_path / "out", "module")

    # the reference itself covers what the contract names
    assert {module_of(t) for t in exp} == set(NAMES)
    assert "pos_emb.output.0" in exp and "pos_emb.grad_output.0" not in exp  # frozen
    assert not any(t.startswith("tok_emb.grad_input") for t in exp)  # integer input
    assert len(exp["shared.output.0"]) == 2 and len(exp["shared.grad_output.0"]) == 2
    assert len(exp["shared.grad_input.0"]) == 2
    # ReLU(inplace=True): input recorded before the module modified it
    act_in = find_row(rows, step=0, module_name="blocks.0.mlp.act.input.0")
    assert float(act_in["min"]) < 0
    assert float(find_row(rows, step=0, module_name="blocks.0.mlp.act.output.0")["min"]) == 0.0
    # fc's output is the very tensor the in-place ReLU overwrites; its row has the values before
    fc_out = find_row(rows, step=0, module_name="blocks.0.mlp.fc.output.0")
    assert float(fc_out["min"]) < 0
    # the root's name is its class name; its output.0 is the loss
    loss_row = find_row(rows, step=0, module_name=f"{ROOT}.output.0", scope="forward")
    check(loss_row, exp[f"{ROOT}.output.0"])
    grad_loss = find_row(rows, step=0, module_name=f"{ROOT}.grad_output.0", scope="backward")
    assert float(grad_loss["min"]) == float(grad_loss["max"]) == 1.0
    # and every row, forward and backward, equals the reference; nothing missing, nothing extra
    assert_rows_match_reference(rows, exp, step=0)


def test_shared_module_merges_both_calls(tmp_path, no_monitor_errors):
    model = TinyGPT()
    data = make_data(1, seed=5)
    exp = expected(model, data)
    run_monitored(model, [data], cfg(tmp_path, targets=["shared"]))
    rows = rows_of(tmp_path / "out", "module")
    assert sorted(tag_of(r) for r in rows) == sorted(
        ["shared.input.0", "shared.output.0", "shared.grad_input.0", "shared.grad_output.0"])
    for kind in KINDS:
        first, second = exp[f"shared.{kind}.0"]
        s1, s2 = numpy_stats(first), numpy_stats(second)
        row = find_row(rows, step=0, module_name=f"shared.{kind}.0")
        assert_row_matches(row, {
            "min": min(s1["min"], s2["min"]),
            "max": max(s1["max"], s2["max"]),
            "mean": (s1["mean"] * first.numel() + s2["mean"] * second.numel()) / (first.numel() + second.numel()),
            "norm": math.sqrt(s1["norm"] ** 2 + s2["norm"] ** 2),
            "nans": 0,
        }, rtol=1e-4, atol=1e-7)


@pytest.mark.filterwarnings("ignore:For backward hooks to be called:UserWarning",
                            "ignore:Full backward hook is firing:UserWarning")
def test_monitor_agrees_with_full_backward_hook_without_inplace(tmp_path, no_monitor_errors):
    """Cross-check of the gradient definitions: on a variant without in-place ops and
    without checkpointing, ``register_full_backward_hook`` works, and wherever it reports a
    gradient the monitor's row and the autograd.grad reference both equal it."""
    model = TinyGPT(ckpt=None, inplace=False)
    hooked = fresh_copy(model)
    data = make_data(1, seed=3)
    exp = expected(model, data)

    seen = defaultdict(list)
    for name, mod in hooked.named_modules():
        tag = name or ROOT

        def bw(m, grad_input, grad_output, tag=tag):
            for kind, grads in (("grad_input", grad_input), ("grad_output", grad_output)):
                for i, g in enumerate(grads):
                    if g is not None:
                        seen[f"{tag}.{kind}.{i}"].append(g.detach().clone())

        mod.register_full_backward_hook(bw)
    idx, tgt = data[0]
    hooked(idx, targets=tgt).loss.backward()
    # modules whose outputs are plain tensors or tuples of tensors (what the hook can wrap)
    must = ["blocks.0.mlp.fc.grad_output.0", "blocks.0.mlp.act.grad_input.0", "blocks.0.attn.grad_input.0",
            "blocks.1.grad_output.0", "blocks.1.grad_input.0", "shared.grad_input.0", "shared.grad_output.0",
            "ln_f.grad_input.0", "head.lm_head.grad_output.0", "split.grad_output.2"]
    assert set(must) <= set(seen), sorted(set(must) - set(seen))

    run_monitored(model, [data], cfg(tmp_path))
    rows = rows_of(tmp_path / "out", "module")
    for tag, grads in seen.items():
        if tag.startswith("split.grad_output"):
            continue  # the hook numbers tuple slots (the int included), the contract numbers tensors
        if tag.endswith(".grad_input.1") and tag.startswith("blocks."):
            assert not any(g.any() for g in grads)  # the bool mask: the hook reports zeros
            assert not [r for r in rows if r["module_name"] == tag], "no gradient row for an input without grad"
            continue
        want, ours = stats_of(grads), stats_of(exp[tag])  # the reference agrees with the hook
        assert all(math.isclose(want[k], ours[k], rel_tol=1e-5, abs_tol=1e-9) for k in want), tag
        check(find_row(rows, step=0, module_name=tag), grads)
    # tuple (a, 7, b): the hook's slot 2 is the contract's grad_output.1
    check(find_row(rows, step=0, module_name="split.grad_output.1"), seen["split.grad_output.2"])


@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
def test_training_is_bit_identical(tmp_path, ckpt, no_monitor_errors):
    """Test 3: AdamW, 3 steps, every module monitored with all ops, in-place ops and a
    checkpointed block: losses and parameters equal bit for bit."""
    torch.manual_seed(0)
    model = TinyGPT(ckpt=ckpt)
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    steps = [[b] for b in make_data(3, seed=7)]

    plain_losses = []
    for micro in steps:
        for idx, tgt in micro:
            loss = plain(idx, targets=tgt).loss
            loss.backward()
            plain_losses.append(loss.detach().clone())
        plain_opt.step()
        plain_opt.zero_grad()

    config = cfg(tmp_path, targets=[], ops=["min", "max", "mean", "norm", "nans"])
    _, losses = run_monitored(model, steps, config, optimizer=opt)
    assert len(losses) == 3
    for a, b in zip(losses, plain_losses):
        assert torch.equal(a, b)
    for (n, p), (n2, p2) in zip(model.named_parameters(), plain.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
    assert model.head.lm_head.weight is model.tok_emb.weight
    rows = rows_of(tmp_path / "out", "module")
    assert {r["step"] for r in rows} == {"0", "1", "2"}
    assert find_row(rows, step=2, module_name="blocks.0.mlp.act.grad_output.0", scope="backward")
    # after stop(), no hook is left
    for mod in model.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks


@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
def test_checkpointed_block_forward_counted_once(tmp_path, ckpt, no_monitor_errors):
    """Test 4: recomputation during backward adds no forward statistics."""
    model = TinyGPT(ckpt=ckpt)
    ref = fresh_copy(model)
    data = make_data(1, seed=11)
    outs = {}

    def keep(key):
        def hook(m, a, o):
            outs[key] = o.detach().clone()  # returns None: the output is not replaced
        return hook

    ref.blocks[1].register_forward_hook(keep("out"))
    ref.blocks[1].mlp.fc.register_forward_hook(keep("fc"))
    with torch.no_grad():
        ref(*data[0])
    run_monitored(model, [data], cfg(tmp_path, targets=["blocks.1"]))
    rows = rows_of(tmp_path / "out", "module")
    for tag, t in (("blocks.1.output.0", outs["out"]), ("blocks.1.mlp.fc.output.0", outs["fc"])):
        row = find_row(rows, step=0, module_name=tag, scope="forward")
        want = numpy_stats(t)
        assert math.isclose(float(row["norm"]), want["norm"], rel_tol=1e-5)  # not sqrt(2) times it
        assert math.isclose(float(row["mean"]), want["mean"], rel_tol=1e-4, abs_tol=1e-6)
        assert_row_matches(row, want, rtol=1e-4, atol=1e-6)
    # gradients of the checkpointed block are recorded once as well
    for tag in ("blocks.1.grad_output.0", "blocks.1.grad_input.0", "blocks.1.ln2.grad_output.0",
                "blocks.1.attn.qkv.grad_input.0"):
        assert len([r for r in rows if r["module_name"] == tag]) == 1, tag


def test_no_grad_eval_and_inference_mode(tmp_path, no_monitor_errors):
    """Test 5: forward rows only, under the evaluation scope, no backward rows, no error;
    then a training step still gets its forward and backward rows."""
    model = TinyGPT()
    ref = fresh_copy(model)
    data = make_data(3, seed=13)
    mon = TrainerMonitorV2(cfg(tmp_path))
    mon.start(model=model)
    model.eval()
    with torch.no_grad():
        model(*data[0])
    mon.step()  # step 0: no_grad + eval
    with torch.inference_mode():
        model(*data[1])
    mon.step()  # step 1: inference_mode
    model.train()
    model(*data[2]).loss.backward()
    mon.step()  # step 2: training
    mon.stop()
    assert mon.errors.count == 0
    rows = rows_of(tmp_path / "out", "module")
    for step in (0, 1):
        step_rows = [r for r in rows if r["step"] == str(step)]
        assert step_rows and all(r["scope"] == "eval_forward" for r in step_rows)
        ref.eval()
        with torch.no_grad():
            exp = _reference(ref, [data[step]], grads=False)
        assert_rows_match_reference(rows, exp, step, forward_scope="eval_forward")
    assert {r["scope"] for r in rows if r["step"] == "2"} == {"forward", "backward"}


@pytest.mark.parametrize(
    "targets, modules",
    [
        ([], set(NAMES)),
        (["attn"], {"blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj",
                    "blocks.1.attn", "blocks.1.attn.qkv", "blocks.1.attn.proj"}),
        (["ln_f", "mlp.fc", "lm_head"], {"ln_f", "blocks.0.mlp.fc", "blocks.1.mlp.fc", "head.lm_head"}),
        ([ROOT], {ROOT}),
    ],
    ids=["all", "one", "several", "root"],
)
def test_targets_select_modules(tmp_path, targets, modules, no_monitor_errors):
    model = TinyGPT()
    run_monitored(model, [make_data(1)], cfg(tmp_path, targets=targets))
    rows = rows_of(tmp_path / "out", "module")
    assert {module_of(tag_of(r)) for r in rows} == modules
    assert not [r for r in no_monitor_errors.records if r.name.startswith(LOGGER) and "match" in r.getMessage()]


def test_target_matching_nothing_warns(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = TinyGPT()
    mon, _ = run_monitored(model, [make_data(1)], cfg(tmp_path, targets=["no_such_layer", "ln_f", "zz_missing"]))
    rows = rows_of(tmp_path / "out", "module")
    assert {module_of(tag_of(r)) for r in rows} == {"ln_f"}
    warnings = [r for r in caplog.records if r.name.startswith(LOGGER) and r.levelno == logging.WARNING
                and "no_such_layer" in r.getMessage()]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "zz_missing" in msg and "'ln_f'" not in msg


def test_gradient_accumulation_one_row_per_tag_and_step(tmp_path, no_monitor_errors):
    """Test 7: two micro-batches per step, two steps, SGD: one row per tag per step,
    aggregated over both micro-batches."""
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = make_data(4, seed=17)
    steps = [data[0:2], data[2:4]]
    mon = TrainerMonitorV2(cfg(tmp_path))
    mon.start(model=model, optimizer=opt, grad_acc_steps=2)
    per_step = []
    for micro in steps:
        per_step.append([expected(model, [mb], loss_scale=0.5) for mb in micro])
        for idx, tgt in micro:
            (model(idx, targets=tgt).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    mon.stop()
    assert mon.errors.count == 0
    rows = rows_of(tmp_path / "out", "module")
    for s, (m1, m2) in enumerate(per_step):
        n1 = numpy_stats(m1["ln_f.grad_output.0"][0])["norm"]
        n2 = numpy_stats(m2["ln_f.grad_output.0"][0])["norm"]
        assert n1 > 0 and n2 > 0 and not math.isclose(n1, n2)
        row = find_row(rows, step=s, module_name="ln_f.grad_output.0")
        assert math.isclose(float(row["norm"]), math.sqrt(n1 ** 2 + n2 ** 2), rel_tol=1e-5)
        assert float(find_row(rows, step=s, module_name=f"{ROOT}.grad_output.0")["norm"]) == pytest.approx(
            math.sqrt(0.5 ** 2 * 2))
        merged = {tag: m1[tag] + m2[tag] for tag in set(m1) | set(m2)}
        assert_rows_match_reference(rows, merged, step=s, check_missing=False)
    assert {r["step"] for r in rows} == {"0", "1"}
    for s, (m1, m2) in enumerate(per_step):
        assert_rows_match_reference(rows, {tag: m1[tag] + m2[tag] for tag in set(m1) | set(m2)}, step=s)


def test_structured_outputs_and_keyword_inputs(tmp_path, no_monitor_errors):
    """Test 8: tuple/dataclass outputs are numbered over tensors only, in order; dict
    outputs are named by key; a keyword argument comes after the positional ones."""
    model = TinyGPT()
    ref = fresh_copy(model)
    data = make_data(1, seed=19)
    captured = {}

    def keep(key):
        def hook(m, args, kwargs):
            captured[key] = [t.detach().clone() for t in (*args, *kwargs.values())]  # returns None
        return hook

    for key in ("split", "mixer", "head"):
        getattr(ref, key).register_forward_pre_hook(keep(key), with_kwargs=True)
    with torch.no_grad():
        ref(*data[0])
    run_monitored(model, [data], cfg(tmp_path, targets=["split", "mixer", "head", "attn"]))
    rows = rows_of(tmp_path / "out", "module")
    tags = {tag_of(r) for r in rows if r["scope"] == "forward"}

    # tuple (a * 2, 7, tanh(b))
    (x,) = captured["split"]
    a, b = x.chunk(2, dim=-1)
    assert {t for t in tags if t.startswith("split.output")} == {"split.output.0", "split.output.1"}
    assert_row_matches(find_row(rows, module_name="split.output.0"), numpy_stats(a * 2), rtol=1e-5, atol=1e-6)
    assert_row_matches(find_row(rows, module_name="split.output.1"), numpy_stats(torch.tanh(b)), rtol=1e-5, atol=1e-6)
    # dict {"h": cat, "n": 3, "gate": Linear(b)}: named by key
    ma, mb = captured["mixer"]
    assert {t for t in tags if t.startswith("mixer.output")} == {"mixer.output.h", "mixer.output.gate"}
    assert_row_matches(find_row(rows, module_name="mixer.output.h"), numpy_stats(torch.cat([ma, mb], -1)),
                       rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        gate = ref.mixer.gate(mb)
    assert_row_matches(find_row(rows, module_name="mixer.output.gate"), numpy_stats(gate), rtol=1e-5, atol=1e-6)
    # dataclass LMOutput(loss, n_tokens: int, logits)
    h, targets = captured["head"]
    with torch.no_grad():
        logits = ref.head.lm_head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert {t for t in tags if t.startswith("head.output")} == {"head.output.0", "head.output.1"}
    assert_row_matches(find_row(rows, module_name="head.output.0"), numpy_stats(loss), rtol=1e-5, atol=1e-6)
    assert_row_matches(find_row(rows, module_name="head.output.1"), numpy_stats(logits), rtol=1e-5, atol=1e-6)
    # keyword arguments after positional ones: head(h, targets=...), attn(x, mask=...)
    assert_row_matches(find_row(rows, module_name="head.input.0"), numpy_stats(h), rtol=1e-5, atol=1e-6)
    assert_row_matches(find_row(rows, module_name="head.input.1"), numpy_stats(targets), rtol=1e-6)
    mask = find_row(rows, module_name="blocks.0.attn.input.1")
    assert_row_matches(mask, {"min": 0.0, "max": 1.0, "mean": (T * (T + 1) / 2) / (T * T),
                              "norm": math.sqrt(T * (T + 1) / 2), "nans": 0})
    assert not any(t.startswith("blocks.0.attn.input.2") for t in tags)
    # backward numbering follows the same order
    btags = {tag_of(r) for r in rows if r["scope"] == "backward"}
    assert {"split.grad_output.0", "split.grad_output.1", "mixer.grad_output.h", "mixer.grad_output.gate",
            "head.grad_output.0", "mixer.grad_input.0", "mixer.grad_input.1", "head.grad_input.0"} <= btags
    assert "head.grad_input.1" not in btags  # integer targets
    assert "blocks.0.attn.grad_input.1" not in btags  # bool mask


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 6)], ids=["2d", "3d"])
def test_inplace_relu_on_linear_output_keeps_gradient_rows(tmp_path, shape, no_monitor_errors):
    """nn.Linear on a 3-D input returns a view of its matmul result; ReLU(inplace=True)
    on it rebases the autograd graph. The Linear's grad_output and the ReLU's grad_input
    (the same gradient, w.r.t. the Linear's output) must still be recorded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(inplace=True), nn.Linear(10, 3))
    x = torch.randn(*shape)
    ref = copy.deepcopy(model)
    h = ref[0](x)
    expected = torch.autograd.grad(ref[2](torch.relu(h)).square().sum(), h)[0]

    mon = TrainerMonitorV2(cfg(tmp_path, targets=["0", "1"]))
    mon.start(model=model)
    model(x).square().sum().backward()
    mon.step()
    mon.stop()
    rows = rows_of(tmp_path / "out", "module")
    for tag in ("0.grad_output.0", "1.grad_input.0"):
        assert_row_matches(find_row(rows, module_name=tag, scope="backward"), numpy_stats(expected),
                           rtol=1e-5, atol=1e-7)


class _Marker:
    pass


class _MarkNode(torch.autograd.Function):
    """Identity whose autograd node owns a weakly referenced marker: the marker dies
    when that node (and so the graph around it) is freed."""

    markers: List = []

    @staticmethod
    def forward(ctx, x):
        ctx.marker = _Marker()
        _MarkNode.markers.append((torch._C._current_autograd_node() is not None, weakref.ref(ctx.marker)))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(12, 6)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(_MarkNode.apply(x))))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        return self.head(checkpoint(self.inner, x, use_reentrant=False)).square().sum()


@pytest.mark.parametrize("monitored", [False, True])
def test_recomputed_graph_is_freed_after_backward(tmp_path, monitored, no_monitor_errors):
    """Non-reentrant checkpointing stops recomputation early (an exception inside the
    recomputed forward), so some forward hooks of the recomputed modules never run. The
    monitor must not keep the recomputed graph (activation checkpointing's whole point is
    to free it) alive after backward: over many micro-batches that memory would add up."""
    torch.manual_seed(0)
    model = _Outer()
    mon = None
    if monitored:
        mon = TrainerMonitorV2(cfg(tmp_path))
        mon.start(model=model, grad_acc_steps=3)
    _MarkNode.markers = []
    for _ in range(3):  # three micro-batches of one step
        model(torch.randn(4, 6, requires_grad=True)).backward()
    gc.collect()
    recomputed = [ref for in_backward, ref in _MarkNode.markers if in_backward]
    assert len(recomputed) == 3
    alive = [ref() is not None for ref in recomputed]
    if mon is not None:
        mon.step()
        mon.stop()
    assert not any(alive), f"recomputed graphs still referenced after backward: {alive}"


# --------------------------------------------------------------- Hugging Face model
@needs("transformers", "this test trains a Hugging Face GPT-2 built from a config")
def test_huggingface_gpt2_trains_identically(tmp_path, no_monitor_errors):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.train()
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(23)
    batches = [torch.randint(0, 100, (2, 16), generator=g) for _ in range(3)]

    def train(m, mon_config=None):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        mon = None
        if mon_config is not None:
            mon = TrainerMonitorV2(mon_config)
            mon.start(model=m, optimizer=opt)
        losses, logits = [], []
        for s, ids in enumerate(batches):
            torch.manual_seed(100 + s)  # same dropout masks in both runs
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.detach().clone())
            logits.append(out.logits.detach().clone())
        if mon is not None:
            mon.stop()
            assert mon.errors.count == 0
        return losses, logits

    plain_losses, plain_logits = train(plain)
    losses, logits = train(model, cfg(tmp_path))
    for a, b in zip(losses, plain_losses):
        assert torch.equal(a, b)
    for (n, p), (_, p2) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, p2), n

    rows = rows_of(tmp_path / "out", "module")
    for s in range(3):
        # a ModelOutput is a dict: named by key
        loss_row = find_row(rows, step=s, module_name="GPT2LMHeadModel.output.loss", scope="forward")
        assert_row_matches(loss_row, numpy_stats(plain_losses[s]), rtol=1e-6)
        assert_row_matches(find_row(rows, step=s, module_name="GPT2LMHeadModel.output.logits"),
                           numpy_stats(plain_logits[s]), rtol=1e-4, atol=1e-6)
        assert float(find_row(rows, step=s, module_name="GPT2LMHeadModel.grad_output.loss")["max"]) == 1.0
        for tag in ("lm_head.grad_output.0", "transformer.h.0.mlp.c_fc.grad_output.0",
                    "transformer.h.1.attn.c_attn.grad_input.0", "transformer.wte.output.0"):
            find_row(rows, step=s, module_name=tag)
    backward = {module_of(tag_of(r)) for r in rows if r["scope"] == "backward"}
    assert {"transformer.h.0", "transformer.h.1.mlp", "transformer.ln_f", "lm_head"} <= backward


class BiasOutLinear(nn.Module):
    """Returns its bias as a second output, as Megatron's linear layers do with
    skip_bias_add; ``leaf`` adds a third output that is a plain leaf tensor."""

    def __init__(self, leaf: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.bias = nn.Parameter(torch.randn(4))
        self.leaf = torch.ones(4, requires_grad=True) if leaf else None

    def forward(self, x: torch.Tensor):
        out = (x @ self.weight.t(), self.bias)
        return out + (self.leaf,) if self.leaf is not None else out


@pytest.mark.parametrize("leaf", [False, True], ids=["bias-only", "bias-and-leaf"])
def test_parameter_returned_as_output_is_recorded_without_warning(tmp_path, caplog, leaf):
    """A Parameter among the outputs gets its forward row and no 'leaf tensor' warning
    (its gradient is the parameter's, in weight_grad); another leaf output still warns."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = BiasOutLinear(leaf)
    mon = TrainerMonitorV2(cfg(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon.start(model=model, optimizer=opt)
    x = torch.randn(2, 3)
    outs = model(x)
    (outs[0] + outs[1]).sum().backward()
    bias = model.bias.detach().clone()
    opt.step()
    mon.stop()
    rows = rows_of(tmp_path / "out", "module")
    assert_row_matches(find_row(rows, step=0, module_name="BiasOutLinear.output.1"), numpy_stats(bias))
    warned = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER) and "leaf tensor" in r.getMessage()]
    assert warned == (["monitor_v2 module: output 2 of BiasOutLinear is a leaf tensor; its gradient is not observed "
                       "(logged once)"] if leaf else [])
