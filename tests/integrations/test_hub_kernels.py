"""transformers 5 with its hub kernels (the real ``kernels`` package): a model loaded with
``from_pretrained`` is kernelized (``use_kernels`` defaults to True), and every ``train()`` or
``eval()`` that changes its mode kernelizes it again: ``kernels``' ``kernelize`` pops the
instance ``forward`` of each module whose class it marks (``LlamaRMSNorm``,
``SiLUActivation``), or sets a kernel's there where one exists for the device. On the CPU,
offline, no kernel exists for the device and ``kernelize`` takes its fallback, which is the
popping of the instance forward, the same code that runs on a GPU when a kernel cannot be
used. ``model.train()`` comes between ``start()`` and the first step, as the Trainer's
``training_step`` calls it: every norm and activation module has its rows at step 0, values
checked against NumPy statistics of clones taken on an unmonitored copy, and the training is
bit-identical to that copy's.

The model is a tiny Llama built from a config, saved with ``save_pretrained`` into the
test's folder and loaded back with ``from_pretrained`` (no download)."""

import types

import pytest
import torch

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.extras import require

transformers = require("transformers", "the hub kernels test loads a Llama with transformers 5's from_pretrained")
kernels = require("kernels", "transformers 5 kernelizes models loaded with from_pretrained through it")

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

STEPS, VOCAB, SEQ, BATCH = 3, 32, 8, 2
EVERY_MODULE = {"module": {"enabled": True, "targets": []}}


def _saved_llama(folder) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _kernelized(module: torch.nn.Module) -> bool:
    return getattr(type(module), "kernel_layer_name", None) is not None


class _Holder(torch.nn.Module):
    """A module holding the language model that is never called itself (as a LightningModule
    whose ``training_step`` calls its model): no model chunk's call comes before the norms'."""

    def __init__(self, llm: torch.nn.Module) -> None:
        super().__init__()
        self.llm = llm


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


@pytest.mark.parametrize("root", ["model", "holder"])
def test_modules_kernelized_again_on_train_lose_no_row(tmp_path, monkeypatch, root):
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    assert int(transformers.__version__.split(".")[0]) >= 5, transformers.__version__
    folder = _saved_llama(tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.use_kernels and ref.use_kernels, "from_pretrained kernelizes by default"
    marked = [name for name, m in model.named_modules() if _kernelized(m)]
    assert "model.norm" in marked and "model.layers.0.mlp.act_fn" in marked, marked
    assert len(marked) == 2 * 3 + 1, "two norms and an activation a layer, the final norm"
    # the real kernelize on train(): it pops an instance forward of a marked module (set here
    # on the unmonitored copy, the class's own forward, so that nothing it computes changes)
    norm = ref.model.norm
    vars(norm)["forward"] = types.MethodType(type(norm).forward, norm)
    ref.train()
    assert "forward" not in vars(norm), "train() kernelized the model again"

    # the unmonitored copy's norm and activation tensors, cloned
    seen = {}

    def keep(name):
        def forward_hook(module, args, output):
            if torch.is_grad_enabled():
                seen.setdefault(name, []).append(("input", args[0].detach().clone()))
                seen[name].append(("output", output.detach().clone()))
                output.register_hook(lambda g: seen[name].append(("grad_output", g.detach().clone())))
        return forward_hook

    handles = [ref.get_submodule(name).register_forward_hook(keep(name)) for name in marked]
    started = _Holder(model) if root == "holder" else model
    prefix = "llm." if root == "holder" else ""
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    mon = TrainerMonitorV2({"output_dir": str(tmp_path / "out"), "monitors": EVERY_MODULE})
    mon.start(model=started, optimizer=opt)
    losses, ref_losses = [], []
    for step, ids in enumerate(_batches()):
        for m, o, out in ((model, opt, losses), (ref, ref_opt, ref_losses)):
            m.train()  # as the Trainer's training_step: kernelized again where the mode changes
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            out.append(loss.detach())
            o.step()
            o.zero_grad()
            if step == 0:  # an evaluation between steps: eval(), then train() kernelizes again
                m.eval()
                with torch.no_grad():
                    m(input_ids=ids)
        if step == 0:
            seen_at_step_0 = {name: list(kept) for name, kept in seen.items()}
    mon.stop()
    for handle in handles:
        handle.remove()
    assert mon.errors.count == 0
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))

    rows = rows_of(tmp_path / "out", "module")
    for name in marked:
        kept = seen_at_step_0[name]
        for kind, scope in (("input", "forward"), ("output", "forward"), ("grad_output", "backward")):
            tensors = [t for k, t in kept if k == kind]
            assert len(tensors) == 1, (name, kind, len(tensors))
            row = find_row(rows, step=0, module_name=f"{prefix}{name}.{kind}.0", scope=scope)
            assert_row_matches(row, numpy_stats(tensors[0]))
        for step in range(1, STEPS):
            find_row(rows, step=step, module_name=f"{prefix}{name}.output.0", scope="forward")
    assert not any(_kernelized(m) and (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())
