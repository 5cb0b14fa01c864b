"""TRL 1.16 on transformers 5: ``SFTTrainer`` with ``MonitorTrainerCallback``, as its users
run it (its defaults: bf16 autocast, non-reentrant gradient checkpointing, fused AdamW, its
fused LM head; the model given by its folder, so TRL loads it with ``from_pretrained`` and
transformers 5 kernelizes it). A tiny Llama and a word-level tokenizer trained in the test are
saved into the test's folder (no download). Every step has the final norm's rows (its class is
one the hub kernels swap forwards of, kernelized again by the Trainer's ``model.train()`` after
``start()``), its values match clones taken in an unmonitored run, ``unreduced`` matches the
accumulated gradients, and the training is bit-identical."""

import logging

import torch

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.extras import require

transformers = require("transformers", "TRL's trainers are transformers Trainers")
trl = require("trl", "the TRL test trains with its SFTTrainer")
datasets = require("datasets", "TRL's trainers take a datasets.Dataset")
tokenizers = require("tokenizers", "the TRL test trains a word-level tokenizer in-process")

from msprobe.core.monitor_v2.integrations import MonitorTrainerCallback  # noqa: E402

STEPS, GRAD_ACC, BATCH, WORDS = 3, 2, 2, 20


def _saved_model(folder) -> str:
    """A word-level tokenizer trained here and a tiny Llama, both saved into ``folder``."""
    words = [f"w{i}" for i in range(WORDS)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(words)], tokenizers.trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "[PAD]", "[EOS]"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                     eos_token="[EOS]")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _texts():
    g = torch.Generator().manual_seed(1)
    return [" ".join(f"w{i}" for i in torch.randint(0, WORDS, (8,), generator=g).tolist())
            for _ in range(STEPS * GRAD_ACC * BATCH)]


def _train(tmp_path, name, folder, callback_config=None):
    args = trl.SFTConfig(output_dir=str(tmp_path / f"sft_{name}"), max_steps=STEPS, per_device_train_batch_size=BATCH,
                         gradient_accumulation_steps=GRAD_ACC, max_length=16, learning_rate=1e-2, logging_steps=1,
                         save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
                         dataloader_num_workers=0)
    callbacks = [MonitorTrainerCallback(callback_config)] if callback_config else []
    trainer = trl.SFTTrainer(model=folder, args=args, train_dataset=datasets.Dataset.from_dict({"text": _texts()}),
                             callbacks=callbacks)
    model = trainer.model
    assert model.use_kernels, "from_pretrained kernelizes by default"
    unreduced, norm = {}, {}
    clip = trainer.accelerator.clip_grad_norm_

    def clip_with_clones(parameters, *a, **kw):
        parameters = list(parameters)
        unreduced[trainer.state.global_step] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        return clip(parameters, *a, **kw)

    trainer.accelerator.clip_grad_norm_ = clip_with_clones
    if callback_config is None:  # the unmonitored run's clones of the final norm's tensors
        def keep(module, args, output):
            if torch.is_grad_enabled():
                key = trainer.state.global_step
                norm.setdefault((key, "input"), []).append(args[0].detach().clone())
                norm.setdefault((key, "output"), []).append(output.detach().clone())
                output.register_hook(lambda g: norm.setdefault((key, "grad_output"), []).append(g.detach().clone()))

        model.model.norm.register_forward_hook(keep)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses, unreduced, norm, args


def test_sft_trainer_keeps_every_row_and_the_training(tmp_path, caplog):
    folder = _saved_model(tmp_path / "llama")
    out = tmp_path / "out"
    config = {"output_dir": str(out), "monitors": {"weight_grad": {"enabled": True},
                                                   "module": {"enabled": True, "targets": ["model.norm"]}}}
    with caplog.at_level(logging.WARNING, logger="msprobe.monitor_v2"):
        model, losses, unreduced, _, args = _train(tmp_path, "on", folder, config)
    assert args.bf16 and args.activation_checkpointing, "TRL's defaults, as its users run it"
    plain, plain_losses, _, norm, _ = _train(tmp_path, "off", folder)
    assert losses == plain_losses and len(losses) == STEPS
    for (n, p), (n2, p2) in zip(model.named_parameters(), plain.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    rows = rows_of(out, "module")
    for step in range(STEPS):
        for kind, scope in (("input", "forward"), ("output", "forward"), ("grad_output", "backward")):
            kept = norm[(step, kind)]
            assert len(kept) == GRAD_ACC, (step, kind)
            row = find_row(rows, step=step, module_name=f"model.norm.{kind}.0", scope=scope)
            assert_row_matches(row, numpy_stats(torch.cat(kept).float()), rtol=1e-3, atol=1e-6)
    grads = rows_of(out, "weight_grad")
    for step in range(STEPS):
        for name, grad in unreduced[step].items():
            row = find_row(grads, step=step, module_name=name, scope="unreduced")
            assert_row_matches(row, numpy_stats(grad), rtol=1e-4, atol=1e-6)
