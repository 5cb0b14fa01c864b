"""weight_grad under a chunked loss: several backward passes per micro-batch.

The loss is TorchTitan's ``ChunkedLossWrapper`` written out (``chunked_backward``): the
model's forward without its head gives hidden states, which are detached and cut into 8
pieces along the sequence; each piece goes through ``lm_head`` and the cross-entropy, and
is backpropagated on its own (8 backward passes that reach ``lm_head`` alone); the pieces'
gradients are put together and backpropagated through the trunk (one more pass). With
``grad_acc_steps=2`` a step is 2 micro-batches, 18 backward passes.

``micro_step`` must count the 2 micro-batches (not the 16 passes through ``lm_head``), and
each ``unreduced`` row must hold its micro-batch's whole gradient (all 8 pieces), checked
with NumPy against gradients computed on an unmonitored copy: the accumulated ``.grad``
it really ends the step with, and each micro-batch's own gradient from
``torch.autograd.grad``, summed over the pieces in the order the passes accumulate them.
Training with the monitor is bit-identical to the copy's.

The 2-rank FSDP2 variant (this file is also its ``torchrun`` worker, see ``_worker``) puts
``lm_head`` in its own ``fully_shard`` unit and toggles its gradient sync as TorchTitan
does (off for the first 7 pieces, on for the last: one reduce-scatter per micro-batch),
and once with the sync on for every piece (a reduce-scatter after each pass).
"""

import copy
import logging
import os
import sys
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

from support import assert_row_matches, find_row, numpy_stats, rows_of, run_torchrun
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

VOCAB, DIM, SEQ, BATCH, PIECES = 16, 8, 16, 2, 8
ACC = 2  # micro-batches per step
STEPS = 2
NAMES = ("embed.weight", "body.weight", "body.bias", "norm.weight", "norm.bias", "lm_head.weight")


class TinyLM(torch.nn.Module):
    """An embedding, one block, a norm and an untied head without bias; deterministic."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.body = torch.nn.Linear(DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor, skip_lm_head: bool = False) -> torch.Tensor:
        return trunk(self, tokens) if skip_lm_head else self.lm_head(trunk(self, tokens))


def trunk(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The hidden states, through the submodules (what a LightningModule's step would call)."""
    return model.norm(torch.tanh(model.body(model.embed(tokens))))


def batches(n: int, seed: int = 1) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(n)]


def piece_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (BATCH * SEQ * ACC)


def chunked_backward(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor,
                     through_call: bool = True, fsdp_sync: str = "") -> torch.Tensor:
    """One micro-batch of TorchTitan's chunked loss (see the module doc); its loss.
    ``through_call`` False: the trunk through its submodules, no call of the model itself.
    ``fsdp_sync``: "last" toggles FSDP2's gradient sync of ``lm_head`` as TorchTitan does
    (reduce-scatter at the last piece only), "each" leaves it on for every piece."""
    head = model.lm_head
    hidden = model(tokens, skip_lm_head=True) if through_call else trunk(model, tokens)
    pieces = [p.detach().requires_grad_() for p in hidden.chunk(PIECES, dim=1)]
    if fsdp_sync == "last":
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
    total = torch.zeros(())
    grads = []
    for i, (piece, piece_labels) in enumerate(zip(pieces, labels.chunk(PIECES, dim=1))):
        if fsdp_sync == "last" and i == PIECES - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        loss = piece_loss(head, piece, piece_labels)
        loss.backward()
        grads.append(piece.grad)
        total = total + loss.detach()
    if fsdp_sync == "last":
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.set_requires_gradient_sync(True, recurse=False)
        head.reshard()
    hidden.backward(torch.cat(grads, dim=1))
    return total


def micro_batch_grads(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One micro-batch's own gradients, with ``torch.autograd.grad`` (no ``.grad`` touched):
    ``lm_head``'s summed over the pieces in pass order, the trunk's through the pieces'
    gradients put together."""
    params = dict(model.named_parameters())
    hidden = trunk(model, tokens)
    head_grad = None
    piece_grads = []
    for piece, piece_labels in zip(hidden.detach().chunk(PIECES, dim=1), labels.chunk(PIECES, dim=1)):
        piece = piece.requires_grad_()
        g_head, g_piece = torch.autograd.grad(piece_loss(model.lm_head, piece, piece_labels),
                                              [params["lm_head.weight"], piece])
        head_grad = g_head if head_grad is None else head_grad + g_head
        piece_grads.append(g_piece)
    trunk_names = [n for n in params if n != "lm_head.weight"]
    trunk_grads = torch.autograd.grad(hidden, [params[n] for n in trunk_names], torch.cat(piece_grads, dim=1))
    out = dict(zip(trunk_names, (g.clone() for g in trunk_grads)))
    out["lm_head.weight"] = head_grad.clone()
    return out


def train(cfg, write_config, start_kwargs, through_call=True, zero_to_none=True):
    """The monitored model and an unmonitored copy trained alike; per step the copy's
    gradients: each micro-batch's own and the accumulated ``.grad`` before the update."""
    model = TinyLM()
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    if not zero_to_none:  # gradients that are zeroed, never freed, from the start
        for p in list(model.parameters()) + list(plain.parameters()):
            p.grad = torch.zeros_like(p)
    mon = TrainerMonitorV2(write_config(cfg))
    mon.start(model=model, optimizer=opt, **start_kwargs)
    data = batches(STEPS * ACC)
    expected, losses, plain_losses = [], [], []
    for s in range(STEPS):
        micro = data[s * ACC:(s + 1) * ACC]
        per_micro = [micro_batch_grads(plain, x, y) for x, y in micro]
        for x, y in micro:
            plain_losses.append(chunked_backward(plain, x, y, through_call))
            losses.append(chunked_backward(model, x, y, through_call))
        accumulated = {n: p.grad.clone() for n, p in plain.named_parameters()}
        expected.append((per_micro, accumulated))
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=zero_to_none)
        opt.step()
        opt.zero_grad(set_to_none=zero_to_none)
    mon.stop()
    # the monitor changed nothing the training computes
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    return rows_of(mon.config.output_dir, "weight_grad"), expected


def weight_grad(**fields):
    return {"monitors": {"weight_grad": {"enabled": True, **fields}}}


def unreduced_rows(rows, step, name):
    return [r for r in rows if r["step"] == str(step) and r["module_name"] == name and r["scope"] == "unreduced"]


def test_accumulated_row_is_the_whole_step_gradient_and_micro_step_counts_micro_batches(write_config):
    rows, expected = train(weight_grad(monitor_mbs_grad=False), write_config, {"grad_acc_steps": ACC})
    for s, (_, accumulated) in enumerate(expected):
        for name in NAMES:
            unreduced = unreduced_rows(rows, s, name)
            assert [r["micro_step"] for r in unreduced] == [str(ACC)], name
            assert_row_matches(unreduced[0], numpy_stats(accumulated[name]))
            reduced = find_row(rows, step=s, module_name=name, scope="reduced")
            assert reduced["micro_step"] == str(ACC)
            assert_row_matches(reduced, numpy_stats(accumulated[name]))


def test_per_micro_batch_rows_hold_each_micro_batch_whole(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    rows, expected = train(weight_grad(monitor_mbs_grad=True), write_config, {"grad_acc_steps": ACC})
    for s, (per_micro, accumulated) in enumerate(expected):
        for name in NAMES:
            unreduced = unreduced_rows(rows, s, name)
            assert sorted(r["micro_step"] for r in unreduced) == [str(k) for k in range(1, ACC + 1)], name
            for k, grads in enumerate(per_micro, start=1):
                # lm_head: 8 passes summed (the first micro-batch read from .grad, which was
                # empty; the second summed by the monitor, .grad holding the first)
                row = find_row(unreduced, micro_step=k)
                assert_row_matches(row, numpy_stats(grads[name]))
            reduced = find_row(rows, step=s, module_name=name, scope="reduced")
            assert reduced["micro_step"] == str(ACC)
            assert_row_matches(reduced, numpy_stats(accumulated[name]))
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_per_micro_batch_rows_when_the_gradient_is_zeroed_not_freed(write_config, caplog):
    # zero_grad(set_to_none=False): .grad is never empty when a micro-batch begins, so
    # lm_head's passes are summed by the monitor; the micro-batch in which it is first
    # found split cannot be told apart (said once), every later one is whole.
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    rows, expected = train(weight_grad(monitor_mbs_grad=True), write_config, {"grad_acc_steps": ACC},
                           zero_to_none=False)
    head = unreduced_rows(rows, 0, "lm_head.weight")
    assert [r["micro_step"] for r in head] == ["2"]
    assert_row_matches(head[0], numpy_stats(expected[0][0][1]["lm_head.weight"]))
    for k, grads in enumerate(expected[1][0], start=1):
        row = find_row(unreduced_rows(rows, 1, "lm_head.weight"), micro_step=k)
        assert_row_matches(row, numpy_stats(grads["lm_head.weight"]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'lm_head.weight'" in warnings[0] and "not written" in warnings[0], warnings


def test_undeclared_count_is_told_by_the_model_forwards(write_config, caplog):
    # Nothing declared: each micro-batch's forward of the model marks it.
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    rows, expected = train(weight_grad(monitor_mbs_grad=True), write_config, {})
    for s, (per_micro, _) in enumerate(expected):
        head = unreduced_rows(rows, s, "lm_head.weight")
        assert sorted(r["micro_step"] for r in head) == ["1", "2"]
        for k, grads in enumerate(per_micro, start=1):
            assert_row_matches(find_row(head, micro_step=k), numpy_stats(grads["lm_head.weight"]))
        assert {r["micro_step"] for r in rows if r["step"] == str(s) and r["scope"] == "reduced"} == {"2"}
    assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "declared"])
def test_without_a_forward_of_the_model_the_monitor_cannot_tell_and_says_so_once(write_config, caplog, declared):
    # The trunk is called through its submodules: no forward of the model given to
    # start() marks the micro-batches, so 16 passes reach lm_head in a step.
    caplog.set_level(logging.WARNING, logger="msprobe.monitor_v2")
    start_kwargs = {"grad_acc_steps": ACC} if declared else {}
    rows, expected = train(weight_grad(monitor_mbs_grad=False), write_config, start_kwargs, through_call=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "cannot tell" in warnings[0] and "'lm_head.weight'" in warnings[0] and "16 backward passes" in warnings[0]
    label = str(ACC) if declared else str(ACC * PIECES)  # the declared count, else the passes (as said)
    for s, (_, accumulated) in enumerate(expected):
        unreduced = unreduced_rows(rows, s, "lm_head.weight")
        assert len(unreduced) == 1 and unreduced[0]["micro_step"] == label
        assert_row_matches(unreduced[0], numpy_stats(accumulated["lm_head.weight"]))  # still the whole
        assert {r["micro_step"] for r in rows if r["step"] == str(s) and r["scope"] == "reduced"} == {label}


# ------------------------------------------------------------------- FSDP2, 2 ranks
def test_fsdp2_two_ranks(tmp_path):
    run_torchrun(__file__, tmp_path, timeout=300)
    for rank in range(2):
        ref = torch.load(tmp_path / f"ref_rank{rank}.pt")
        # TorchTitan's sync (one reduce-scatter per micro-batch), monitor_mbs_grad=true:
        # each micro-batch's local gradient, lm_head's read after its last piece
        rows = rows_of(tmp_path / "sync_last_mbs", "weight_grad", rank)
        for s, step in enumerate(ref["sync_last_mbs"]):
            for name in NAMES:
                unreduced = unreduced_rows(rows, s, name)
                assert sorted(r["micro_step"] for r in unreduced) == ["1", "2"], (rank, s, name)
                for k, grads in enumerate(step["local"], start=1):
                    assert_row_matches(find_row(unreduced, micro_step=k), numpy_stats(grads[name]), rtol=1e-4)
                reduced = find_row(rows, step=s, module_name=name, scope="reduced")
                assert reduced["micro_step"] == "2"
                assert_row_matches(reduced, numpy_stats(step["reduced"][name]), rtol=1e-4)
        # one micro-batch a step, monitor_mbs_grad=false: the accumulated row is the whole
        rows = rows_of(tmp_path / "sync_last_one", "weight_grad", rank)
        for s, step in enumerate(ref["sync_last_one"]):
            for name in NAMES:
                unreduced = unreduced_rows(rows, s, name)
                assert [r["micro_step"] for r in unreduced] == ["1"], (rank, s, name)
                assert_row_matches(unreduced[0], numpy_stats(step["local"][0][name]), rtol=1e-4)
        # a reduce-scatter after every piece: the first micro-batch's lm_head row is not
        # written (said once), later ones are summed by the monitor
        rows = rows_of(tmp_path / "sync_each_mbs", "weight_grad", rank)
        steps = ref["sync_each_mbs"]
        assert [r["micro_step"] for r in unreduced_rows(rows, 0, "lm_head.weight")] == ["2"]
        for s, k in ((0, 2), (1, 1), (1, 2)):
            row = find_row(unreduced_rows(rows, s, "lm_head.weight"), micro_step=k)
            assert_row_matches(row, numpy_stats(steps[s]["local"][k - 1]["lm_head.weight"]), rtol=1e-4)
        log = (tmp_path / f"log_rank{rank}.txt").read_text()
        assert log.count("never exists: its 'unreduced' row is not written") == 1, log


def _worker(out_dir: str) -> None:
    """Per rank: four FSDP2 trainings (TorchTitan's sync with monitor_mbs_grad=true and 2
    micro-batches, its unmonitored twin; one micro-batch with monitor_mbs_grad=false;
    the sync on for every piece with monitor_mbs_grad=true), the monitored ones' values
    computed outside the monitor on an unsharded copy loaded with the full parameters at
    each step, and their losses and parameters compared with their twins' bit for bit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from support import finish

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    handler = logging.FileHandler(os.path.join(out_dir, f"log_rank{rank}.txt"))
    logging.getLogger("msprobe.monitor_v2").addHandler(handler)

    def run(tag, sync, acc, mbs):
        model = TinyLM()
        fully_shard(model.lm_head)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        mon = None
        if tag:
            cfg = {"output_dir": os.path.join(out_dir, tag), **weight_grad(monitor_mbs_grad=mbs)}
            path = os.path.join(out_dir, f"{tag}_rank{rank}.json")
            with open(path, "w") as f:
                import json
                json.dump(cfg, f)
            mon = TrainerMonitorV2(path)
            mon.start(model=model, optimizer=opt, grad_acc_steps=acc)
        twin = TinyLM()
        data = batches(STEPS * acc, seed=10 + rank)
        steps, losses = [], []
        for s in range(STEPS):
            micro = data[s * acc:(s + 1) * acc]
            if mon is not None:
                twin.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})
                local = [micro_batch_grads(twin, x, y) for x, y in micro]
            for x, y in micro:
                losses.append(chunked_backward(model, x, y, fsdp_sync=sync))
            if mon is not None:
                steps.append({"local": local,
                              "reduced": {n: p.grad.to_local().clone() for n, p in model.named_parameters()}})
            opt.step()
            opt.zero_grad()
        if mon is not None:
            mon.stop()
        params = [p.full_tensor() for p in model.parameters()]
        return steps, losses, params

    ref = {}
    for tag, sync, acc, mbs in (("sync_last_mbs", "last", 2, True), ("sync_last_one", "last", 1, False),
                                ("sync_each_mbs", "each", 2, True)):
        steps, losses, params = run(tag, sync, acc, mbs)
        _, twin_losses, twin_params = run("", sync, acc, mbs)
        assert all(torch.equal(a, b) for a, b in zip(losses, twin_losses)), tag
        assert all(torch.equal(a, b) for a, b in zip(params, twin_params)), tag
        ref[tag] = steps
    torch.save(ref, os.path.join(out_dir, f"ref_rank{rank}.pt"))
    handler.close()
    finish()


if __name__ == "__main__":
    _worker(sys.argv[1])
