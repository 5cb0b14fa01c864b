"""transformers.Trainer with MonitorTrainerCallback: gradient accumulation, clipping and an
evaluation loop, on CPU with a tiny GPT-2 built from a config, and a dense Llama and a
Qwen3-MoE saved with ``save_pretrained`` and loaded with ``from_pretrained`` from the test's
folder, kernelized by transformers 5's hub kernels (no download).

Reference values are NumPy statistics of clones taken by the test itself: the accumulated
local gradient right before the Trainer clips it (``unreduced``) and the gradient the
optimizer update uses (``reduced``: at ``on_pre_optimizer_step``, after clipping)."""

import logging
import math

import pytest
import torch

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.extras import require

transformers = require("transformers", "the Trainer callback tests train a GPT-2 built from a config with its Trainer")

from msprobe.core.monitor_v2.integrations import MonitorTrainerCallback  # noqa: E402

STEPS, GRAD_ACC, BATCH, TRAIN_VOCAB, SEQ = 6, 2, 2, 16, 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=2 * TRAIN_VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _data(n: int, low: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, low + TRAIN_VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class _Reference(transformers.TrainerCallback):
    """Clones of the gradients the update uses, and the monitor's step, at each step."""

    def __init__(self, monitored=None):
        self.reduced, self.steps_seen = {}, []
        self.monitored = monitored
        self.model = None
        self.tensors = {}  # (step, module name, input/output/grad_output) -> clones, one a training call

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.reduced[state.global_step] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitored is not None:
            self.steps_seen.append((state.global_step, self.monitored.monitor.current_step))


def _watch(model, names, trainer, tensors):
    """Clones of the first input, the first output and its gradient of each module named, at
    each training call (gradients on), by the Trainer's step."""
    def hook(name):
        def forward_hook(module, args, output):
            if not torch.is_grad_enabled():
                return
            out = output[0] if isinstance(output, tuple) else output
            key = (trainer.state.global_step, name)
            tensors.setdefault(key + ("input",), []).append(args[0].detach().clone())
            tensors.setdefault(key + ("output",), []).append(out.detach().clone())
            out.register_hook(lambda g: tensors.setdefault(key + ("grad_output",), []).append(g.detach().clone()))
        return forward_hook

    for name in names:
        model.get_submodule(name).register_forward_hook(hook(name))


def _train(tmp_path, name, callback_config=None, make_model=_model, watch=()):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"hf_{name}"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH, gradient_accumulation_steps=GRAD_ACC, max_grad_norm=0.05,
        learning_rate=1e-2, eval_strategy="steps", eval_steps=2, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    monitored = MonitorTrainerCallback(callback_config) if callback_config else None
    reference = _Reference(monitored)
    callbacks = [c for c in (monitored, reference) if c is not None]
    model = make_model()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(STEPS * GRAD_ACC * BATCH, 0, 1),
                                   eval_dataset=_data(4, TRAIN_VOCAB, 2), callbacks=callbacks)
    _watch(model, watch, trainer, reference.tensors)
    # The accumulated gradient before clipping: clones right before the Trainer's clip call.
    unreduced, batches = {}, {}
    clip = trainer.accelerator.clip_grad_norm_

    def clip_with_clones(parameters, *a, **kw):
        parameters = list(parameters)
        unreduced[trainer.state.global_step] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        return clip(parameters, *a, **kw)

    trainer.accelerator.clip_grad_norm_ = clip_with_clones
    # The training micro-batches' input ids, per step (eval batches run under no_grad).
    model.register_forward_pre_hook(
        lambda m, a, kw: batches.setdefault(trainer.state.global_step, []).append(kw["input_ids"].clone())
        if torch.is_grad_enabled() else None, with_kwargs=True)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    return trainer, model, monitored, reference, unreduced, batches, losses, evals


def _check_weight_grad(out, unreduced, ref):
    """Every parameter's ``unreduced`` (the accumulated gradient before clipping) and ``reduced``
    (the one the update uses) rows at every step against the clones; the rows."""
    rows = rows_of(out, "weight_grad")
    assert sorted({int(r["step"]) for r in rows}) == list(range(STEPS))
    clipped = 0
    for step in range(STEPS):
        for name, grad in unreduced[step].items():
            row = find_row(rows, step=step, module_name=name, scope="unreduced")
            assert row["micro_step"] == str(GRAD_ACC)
            assert_row_matches(row, numpy_stats(grad), rtol=1e-4, atol=1e-6)
            reduced = ref.reduced[step][name]
            assert_row_matches(find_row(rows, step=step, module_name=name, scope="reduced"), numpy_stats(reduced),
                               rtol=1e-4, atol=1e-6)
            clipped += not torch.equal(grad, reduced)
    assert clipped, "max_grad_norm must clip, or 'reduced' and 'unreduced' cannot be told apart"
    return rows


def test_trainer_callback_values_steps_eval_and_bit_identity(tmp_path, caplog):
    out = tmp_path / "out"
    config = {"output_dir": str(out), "monitors": {
        "weight_grad": {"enabled": True}, "module": {"enabled": True, "targets": ["wte"]},
        "param": {"enabled": True}, "optimizer": {"enabled": True}}}
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        trainer, model, monitored, ref, unreduced, batches, losses, evals = _train(tmp_path, "on", config)
    plain = _train(tmp_path, "off")
    # The monitor never changes the training: losses, evaluation losses, parameters.
    assert losses == plain[6] and evals == plain[7] and len(losses) == STEPS and len(evals) == 3
    for (n, p), (n2, p2) in zip(model.named_parameters(), plain[1].named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
    # One monitor step per Trainer step, numbered as the Trainer numbers them; stopped at the end.
    assert trainer.state.global_step == STEPS
    assert ref.steps_seen == [(s, s) for s in range(1, STEPS + 1)]
    assert monitored.monitor is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    rows = _check_weight_grad(out, unreduced, ref)
    # The Trainer logs the update of monitor step s under its global_step s + 1 (it logs
    # after the update): its grad_norm (before clipping) is the norm of step s's 'unreduced'.
    logged = [(h["step"], h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]
    assert [s for s, _ in logged] == list(range(1, STEPS + 1))
    for logged_step, grad_norm in logged:
        norms = [float(r["norm"]) for r in rows if r["step"] == str(logged_step - 1) and r["scope"] == "unreduced"]
        assert len(norms) == len(unreduced[0])
        assert math.isclose(math.sqrt(sum(n * n for n in norms)), grad_norm, rel_tol=1e-4), logged_step

    # The Trainer's own loss and grad_norm, as its log history holds them, are the scalars
    # rows of the step each log entry follows (monitor step = the entry's step - 1); the
    # last step's, logged after it ended, is written by stop() at the end of training.
    scalars = rows_of(out, "scalars")
    history = [(h["step"] - 1, key, h[key]) for h in trainer.state.log_history
               for key in ("loss", "grad_norm") if key in h]
    assert len(history) == 2 * STEPS
    assert [(int(r["step"]), r["module_name"]) for r in scalars] == [(s, k) for s, k, _ in history]
    for row, (_, _, value) in zip(scalars, history):
        assert row["scope"] == "scalars" and row["nans"] == "0"
        for op in ("min", "max", "mean"):
            assert math.isclose(float(row[op]), value, rel_tol=1e-8), (row, value)
        assert math.isclose(float(row["norm"]), abs(value), rel_tol=1e-8)

    # Evaluation passes are not merged into the training steps' forward rows.
    module_rows = rows_of(out, "module")
    name = "transformer.wte.input.0"
    for step in range(STEPS):
        ids = torch.cat(batches[step])
        assert_row_matches(find_row(module_rows, step=step, module_name=name, scope="forward"), numpy_stats(ids))
    # Evaluations after steps 2, 4 and 6 run in monitor steps 2, 4 and 6; step 6 never ends.
    evaluated = [r for r in module_rows if r["module_name"] == name and r["scope"] == "eval_forward"]
    assert [r["step"] for r in evaluated] == ["2", "4"] and all(float(r["min"]) >= TRAIN_VOCAB for r in evaluated)


def _save_pretrained(folder, family: str) -> str:
    """A tiny causal LM of ``family`` built from a config and saved with ``save_pretrained``:
    a dense Llama, or a Qwen3-MoE (4 experts, 2 a token; transformers 5 keeps the experts as
    3-D parameters and the router as a module returning logits, scores and indices)."""
    torch.manual_seed(0)
    common = dict(vocab_size=2 * TRAIN_VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=SEQ)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=32, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=32, moe_intermediate_size=8, head_dim=8, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], **common))
    model.save_pretrained(folder)
    return str(folder)


# modules whose rows are checked against clones: the final norm (its class is one the hub
# kernels swap forwards of), and the first layer's activation, or its router and experts
WATCHED = {"llama": ["model.norm", "model.layers.0.mlp.act_fn"],
           "qwen3_moe": ["model.norm", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts"]}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_trainer_on_a_model_loaded_with_from_pretrained(tmp_path, caplog, family):
    """A dense and a MoE model loaded with ``from_pretrained`` from a local folder, as users load
    them: transformers 5 kernelizes them (hub kernels on by default) and the Trainer's
    ``model.train()`` in every training step, after the evaluations' ``eval()``, kernelizes them
    again. Every step has the rows of every module, those of the norms and activations included
    (none lost to the kernelizing), the watched modules' values match clones taken in the
    unmonitored run, ``unreduced``/``reduced`` match for every parameter (the MoE's 3-D experts
    included), evaluations stay out of the training rows, and the training is bit-identical."""
    folder = _save_pretrained(tmp_path / family, family)

    def load():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert model.use_kernels, "from_pretrained kernelizes by default"
        return model

    out = tmp_path / "out"
    config = {"output_dir": str(out), "monitors": {
        "weight_grad": {"enabled": True}, "module": {"enabled": True}, "param": {"enabled": True},
        "optimizer": {"enabled": True}}}
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        trainer, model, monitored, ref, unreduced, batches, losses, evals = _train(tmp_path, "on", config, load)
    plain = _train(tmp_path, "off", make_model=load, watch=WATCHED[family])
    assert losses == plain[6] and evals == plain[7] and len(losses) == STEPS and len(evals) == 3
    for (n, p), (n2, p2) in zip(model.named_parameters(), plain[1].named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
    assert ref.steps_seen == [(s, s) for s in range(1, STEPS + 1)]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    _check_weight_grad(out, unreduced, ref)
    if family == "qwen3_moe":
        assert any(name.endswith("mlp.experts.gate_up_proj") and g.dim() == 3 for name, g in unreduced[0].items())

    rows = rows_of(out, "module")
    kernelized = [name for name, m in model.named_modules() if getattr(type(m), "kernel_layer_name", None)]
    assert "model.norm" in kernelized and len(kernelized) >= 2 * 2 + 1, kernelized
    called = {name for name, m in model.named_modules() if name and not isinstance(m, torch.nn.ModuleList)
              and name != "model.rotary_emb"}
    for step in range(STEPS):
        names = {r["module_name"] for r in rows if r["step"] == str(step) and r["scope"] == "forward"}
        outputs = {n.split(".output.")[0] for n in names if ".output." in n}
        missing = sorted(called - outputs)
        assert not missing, (step, missing)
        backward = {r["module_name"] for r in rows if r["step"] == str(step) and r["scope"] == "backward"}
        assert all(f"{n}.grad_output.0" in backward for n in kernelized), step
    tensors = plain[3].tensors
    for step in range(STEPS):
        for name in WATCHED[family]:
            for kind, scope in (("input", "forward"), ("output", "forward"), ("grad_output", "backward")):
                kept = tensors[(step, name, kind)]
                assert len(kept) == GRAD_ACC, (step, name, kind)
                row = find_row(rows, step=step, module_name=f"{name}.{kind}.0", scope=scope)
                assert_row_matches(row, numpy_stats(torch.cat(kept)), rtol=1e-4, atol=1e-6)
    evaluated = [r for r in rows if r["module_name"] == "model.norm.output.0" and r["scope"] == "eval_forward"]
    assert [r["step"] for r in evaluated] == ["2", "4"]


def test_trainer_callback_stops_on_exception(tmp_path):
    out = tmp_path / "out"
    callback = MonitorTrainerCallback({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}}})

    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("boom")

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=4,
                                          per_device_train_batch_size=BATCH, report_to=[], use_cpu=True,
                                          save_strategy="no", disable_tqdm=True)
    model = _model()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(8, 0, 1), callbacks=[callback, Boom()])
    optimizer_hooks = None
    with pytest.raises(RuntimeError, match="boom"):
        try:
            trainer.train()
        finally:
            optimizer_hooks = dict(trainer.optimizer.optimizer._optimizer_step_pre_hooks)
    assert callback.monitor is None and optimizer_hooks == {}
    assert sorted({int(r["step"]) for r in rows_of(out, "weight_grad")}) == [0, 1]
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def test_trainer_callback_resumed_run_keeps_the_trainer_step_numbers(tmp_path):
    def run(out, resume=None):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), max_steps=4, per_device_train_batch_size=BATCH, report_to=[],
            use_cpu=True, save_strategy="steps", save_steps=2, disable_tqdm=True, seed=0)
        callback = MonitorTrainerCallback({"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True}}})
        trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data(8, 0, 1), callbacks=[callback])
        trainer.train(resume_from_checkpoint=resume)
        return sorted({int(r["step"]) for r in rows_of(out, "weight_grad")})

    assert run(tmp_path / "first") == [0, 1, 2, 3]
    assert run(tmp_path / "resumed", resume=str(tmp_path / "hf" / "checkpoint-2")) == [2, 3]


def test_trainer_callback_puts_train_back_when_it_stops(tmp_path):
    """The instance-level ``trainer.train`` wrapper (stop on exception) is on the Trainer
    only while the callback runs: after a normal run and after an exception the instance
    has the attributes a Trainer built without the callback has, and ``train`` is the
    class's method again; removing it again changes nothing."""
    def build(callbacks, name, boom_at=None):
        class Boom(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == boom_at:
                    raise RuntimeError("boom")

        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=2,
                                              per_device_train_batch_size=BATCH, report_to=[], use_cpu=True,
                                              save_strategy="no", disable_tqdm=True)
        return transformers.Trainer(model=_model(), args=args, train_dataset=_data(4, 0, 1),
                                    callbacks=callbacks + ([Boom()] if boom_at else []))

    plain = build([], "plain")
    plain_keys = set(vars(plain))
    for boom_at in (None, 1):
        callback = MonitorTrainerCallback({"output_dir": str(tmp_path / f"out{boom_at}"),
                                           "monitors": {"weight_grad": {"enabled": True}}})
        trainer = build([callback], f"hf{boom_at}", boom_at)
        assert set(vars(trainer)) - plain_keys == {"train", "__getstate__"}
        if boom_at is None:
            trainer.train()
        else:
            with pytest.raises(RuntimeError, match="boom"):
                trainer.train()
        assert callback.monitor is None
        assert "train" not in vars(trainer) and "__getstate__" not in vars(trainer)
        assert trainer.train.__func__ is transformers.Trainer.train
        keys_after = set(vars(trainer))
        callback._unguard()
        assert set(vars(trainer)) == keys_after and trainer.train.__func__ is transformers.Trainer.train


def test_trainer_under_ddp_reads_local_gradients_in_one_batch_a_pass(tmp_path):
    """Two gloo ranks: the Trainer wraps the model in DDP (``model_wrapped``) and the
    callback names that DDP to the monitor, so weight_grad reads each backward pass's local
    gradients in one batch at its end. The rows are each rank's local accumulated gradient
    (cloned by a communication hook as it enters the all-reduce), different on the ranks."""
    from pathlib import Path

    from support import run_torchrun

    out = tmp_path / "ddp"
    run_torchrun(Path(__file__).with_name("trainer_ddp_worker.py"), out, nproc=2, timeout=300)
    refs = [torch.load(out / f"ref_rank{r}.pt", weights_only=False) for r in range(2)]
    for r, ref in enumerate(refs):
        assert ref["world"] == 2
        assert ref["batched"] and all(ref["batched"]), ref["batched"]
        rows = rows_of(out / "run", "weight_grad", r)
        assert sorted(ref["local"]) == [0, 1, 2]
        for step, grads in ref["local"].items():
            assert sorted(grads) == sorted(ref["names"])
            for name, grad in grads.items():
                row = find_row(rows, step=step, module_name=name, scope="unreduced")
                assert_row_matches(row, numpy_stats(grad), rtol=1e-4, atol=1e-7)
    name = refs[0]["names"][0]
    assert not torch.equal(refs[0]["local"][0][name], refs[1]["local"][0][name])
