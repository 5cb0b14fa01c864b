"""Worker for test_transformers_trainer.py's DDP case, run by torchrun with 2 gloo ranks:

    trainer_ddp_worker.py OUT_DIR

``transformers.Trainer`` trains a tiny GPT-2 under DDP (gradient accumulation 2, clipping)
with ``MonitorTrainerCallback``. A callback registers a DDP communication hook once the
Trainer has wrapped the model: it clones each parameter's local accumulated gradient as it
enters the all-reduce (``local[step][name]``), then averages as DDP does. Each rank saves
``OUT_DIR/ref_rank<r>.pt`` with those clones, whether weight_grad read the local gradients
in one batch per backward pass (``batched``, at each step's end) and the parameter names.
"""

import os
import sys

import torch
import torch.distributed as dist
import transformers

from msprobe.core.monitor_v2.integrations import MonitorTrainerCallback
from support.ddp import clone_then_average

STEPS, GRAD_ACC, BATCH, VOCAB, SEQ = 3, 2, 2, 16, 6


class CloneLocalGrads(transformers.TrainerCallback):
    def __init__(self, trainer_ref, monitored):
        self.trainer_ref, self.monitored = trainer_ref, monitored
        self.local, self.batched = {}, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        trainer = self.trainer_ref[0]
        ddp = trainer.model_wrapped
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
        names = {id(p): n for n, p in model.named_parameters()}
        ddp.register_comm_hook(None, clone_then_average(self.local, names, lambda: trainer.state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        wg = next(m for m in self.monitored.monitor.monitors if m.name == "weight_grad")
        self.batched.append(wg._batched)


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2 * STEPS * GRAD_ACC * BATCH, SEQ), generator=g)
    data = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GRAD_ACC, max_grad_norm=0.05, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, ddp_backend="gloo",
    )
    monitored = MonitorTrainerCallback({"output_dir": os.path.join(out_dir, "run"),
                                        "monitors": {"weight_grad": {"enabled": True}}})
    trainer_ref = [None]
    clones = CloneLocalGrads(trainer_ref, monitored)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[monitored, clones])
    trainer_ref[0] = trainer
    trainer.train()
    torch.save({"local": clones.local, "batched": clones.batched,
                "names": [n for n, _ in model.named_parameters()], "world": dist.get_world_size()},
               os.path.join(out_dir, f"ref_rank{rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    from support import finish

    finish()
