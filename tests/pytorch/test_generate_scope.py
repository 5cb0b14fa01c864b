"""Generation passes in a scope of their own, ``generate`` (issue 46, part 7).

TRL's GRPO/PPO trainers generate inside their training step (``model.generate`` under
``no_grad``, the model in train mode); a user calls ``model.generate`` between steps to
look at samples. Those forwards (the prefill and every decoding step) are neither the
training step's ``forward`` rows nor evaluation's ``eval_forward``: they go under
``generate``. A real transformers model built from a config (4.x and 5.x alike) trains with
generations and an evaluation pass between its steps; an unmonitored copy, trained and
sampled alike, gives the tensors for the NumPy statistics each scope's rows must equal.
"""

import copy
from typing import Any, Dict, List

import pytest
import torch

from support import assert_row_matches, find_row, numpy_stats, rows_of
from support.extras import require
from msprobe.core.monitor_v2 import rows as row_names
from msprobe.core.monitor_v2.trainer import TrainerMonitorV2

transformers = require("transformers", "these tests call generate() of a real transformers model")
from transformers.generation.utils import GenerationMixin  # noqa: E402

VOCAB, SEQ, STEPS = 48, 8, 3
PROBED = ("lm_head", "model.norm")  # their outputs: (name, kind) -> scope -> tensors


def tiny_llama(cls: type = transformers.LlamaForCausalLM) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return cls(config)


def batches() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (2, SEQ), generator=g) for _ in range(STEPS)]


class Capture:
    """Outputs of the probed modules of the unmonitored copy, by step and scope (as the
    monitor should file them)."""

    def __init__(self, model: torch.nn.Module, prefix: str = "") -> None:
        self.step = 0
        self.scope = row_names.FORWARD
        self.seen: Dict[tuple, List[torch.Tensor]] = {}
        modules = dict(model.named_modules())
        for name in PROBED:
            modules[prefix + name].register_forward_hook(
                lambda m, args, out, name=name: self.seen.setdefault((self.step, self.scope, name), []).append(
                    out.detach().clone()))

    def expected(self, step: int, scope: str, name: str) -> Dict[str, float]:
        return numpy_stats(torch.cat([t.reshape(-1) for t in self.seen[(step, scope, name)]]))


def generate(model: Any, prompt: torch.Tensor) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                          pad_token_id=0)


def run(write_config, model: torch.nn.Module, generating: Any, prefix: str = ""):
    """Train ``model`` (monitored) and a copy (not), ``STEPS`` steps; at steps 1 and 2 both
    generate between their forward and backward pass (as GRPO does, in train mode), and
    at step 2 both also run an evaluation pass. ``generating(model)`` is what
    ``generate`` is called on, ``prefix`` where the probed modules are in ``model``. Returns
    the monitor's module rows and the copy's capture."""
    twin = copy.deepcopy(model)
    capture = Capture(twin, prefix)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    original = vars(GenerationMixin)["generate"]
    mon = TrainerMonitorV2(write_config({"monitors": {"module": {"enabled": True, "targets": list(PROBED)}}}))
    mon.start(model=model, optimizer=opt)
    assert vars(GenerationMixin)["generate"] is not original
    try:
        for step, ids in enumerate(batches()):
            capture.step = step
            for m in (model, twin):
                m.train()
            capture.scope = row_names.FORWARD
            loss = model(input_ids=ids, labels=ids).loss
            twin_loss = twin(input_ids=ids, labels=ids).loss
            if step:
                capture.scope = row_names.GENERATE
                sampled = generate(generating(model), ids[:, :4])
                assert torch.equal(sampled, generate(generating(twin), ids[:, :4]))
            if step == 2:
                capture.scope = row_names.EVAL_FORWARD
                for m in (model, twin):
                    m.eval()
                    with torch.no_grad():
                        m(input_ids=ids)
                    m.train()
            loss.backward()
            twin_loss.backward()
            assert torch.equal(loss, twin_loss)
            opt.step()  # ends the monitor's step
            opt.zero_grad()
            twin_opt.step()
            twin_opt.zero_grad()
    finally:
        mon.stop()
    assert mon.errors.count == 0
    assert vars(GenerationMixin)["generate"] is original  # the wrapper is gone
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    return rows_of(mon.config.output_dir, "module"), capture


def check(module_rows: List[Dict[str, str]], capture: Capture, prefix: str = "") -> None:
    for step in range(STEPS):
        step_rows = [r for r in module_rows if r["step"] == str(step)]
        scopes = {"forward", "backward"} | ({"generate"} if step else set()) | ({"eval_forward"} if step == 2 else set())
        assert {r["scope"] for r in step_rows} == scopes, step
        for name in PROBED:
            for scope in scopes - {"backward"}:
                assert_row_matches(find_row(step_rows, module_name=f"{prefix}{name}.output.0", scope=scope),
                                   capture.expected(step, scope, name), rtol=1e-5, atol=1e-5)


def test_generate_between_forward_and_backward_has_its_own_rows(write_config):
    model = tiny_llama()
    module_rows, capture = run(write_config, model, lambda m: m)
    check(module_rows, capture)


class Wrapper(torch.nn.Module):
    """A wrapper given to start() (as DDP is), whose inner model generates: its calls are
    made outside the wrapper's, where the monitor decides by generate alone."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs)


def test_generate_of_a_wrapped_model_outside_the_wrappers_call(write_config):
    model = tiny_llama()
    wrapper = Wrapper(model)
    module_rows, capture = run(write_config, wrapper, lambda m: m.inner, prefix="inner.")
    check(module_rows, capture, prefix="inner.")


class OwnGeneration(transformers.LlamaForCausalLM):
    """A model class with a ``generate`` of its own that never calls ``GenerationMixin``'s
    (greedy decoding written out, as some speech and multimodal models have)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: Any = None, max_new_tokens: int = 1,
                 **_: Any) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = self(input_ids=input_ids).logits[:, -1]
                input_ids = torch.cat([input_ids, logits.argmax(-1, keepdim=True)], dim=1)
        return input_ids


def test_a_generate_override_that_does_not_call_super(write_config):
    model = tiny_llama(OwnGeneration)
    module_rows, capture = run(write_config, model, lambda m: m)
    check(module_rows, capture)
    assert vars(OwnGeneration)["generate"].__qualname__ == "OwnGeneration.generate"  # put back


def test_two_monitors_share_one_wrapper_removed_with_the_last(write_config, tmp_path):
    original = vars(GenerationMixin)["generate"]
    model = tiny_llama()
    first = TrainerMonitorV2(write_config({"output_dir": str(tmp_path / "a"), "monitors": {"module": {}}}))
    second = TrainerMonitorV2(write_config({"output_dir": str(tmp_path / "b"), "monitors": {"module": {}}}, "b.json"))
    first.start(model=model)
    wrapped = vars(GenerationMixin)["generate"]
    assert wrapped is not original and wrapped.__wrapped__ is original
    second.start(model=model)
    assert vars(GenerationMixin)["generate"] is wrapped  # one wrapper, not one a monitor
    first.stop()
    assert vars(GenerationMixin)["generate"] is wrapped  # the second still uses it
    second.stop()
    assert vars(GenerationMixin)["generate"] is original


@pytest.mark.parametrize("scope", [row_names.GENERATE])
def test_the_analysis_side_knows_the_scope(scope):
    from msprobe.core.monitor_v2 import layout
    from msprobe.core.monitor_v2.analysis import order

    assert scope in row_names.SCOPES[row_names.MODULE]
    assert order.phase(row_names.MODULE, scope) == order.phase(row_names.MODULE, row_names.FORWARD)
    assert scope in layout.PER_DP_SCOPES
