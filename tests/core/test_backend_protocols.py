"""The back-end protocols (``backend.py``) on PyTorch: the session, its statistics engine
and its training stack implement every declared member with a compatible signature
(``inspect.signature``, not only ``isinstance``), every stack adapter class does, and
``reduced_grads()`` hands out the gradients the optimizer then applies (checked against
Adam's first moment after its first step, with NumPy on copies). MindSpore's twin:
``tests/ms/test_ms_backend_protocols.py``."""

import numpy as np
import pytest
import torch

from support import TinyMLP, loss_fn, make_batches
from support.protocols import protocol_mismatches
from msprobe.core.monitor_v2.backend import Session, StatsEngine, TrainingStack
from msprobe.core.monitor_v2.frameworks.pytorch import Session as BackendSession
from msprobe.core.monitor_v2.frameworks.pytorch.session import TorchSession
from msprobe.core.monitor_v2.frameworks.pytorch.stacks import base, deepspeed, megatron
from msprobe.core.monitor_v2.param_table import ParamInfo, ParamTable

NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
BETA1 = 0.9


def _session(tmp_path):
    model = TinyMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(BETA1, 0.999))
    return model, opt, TorchSession(model, opt, {}, str(tmp_path))


def test_the_backend_session_is_the_torch_session():
    assert BackendSession is TorchSession


def test_session_engine_and_stack_implement_the_protocols(tmp_path):
    _, _, session = _session(tmp_path)
    for obj, protocol in ((session, Session), (session.engine, StatsEngine), (session.stack, TrainingStack)):
        assert isinstance(obj, protocol)
        assert protocol_mismatches(obj, protocol) == [], type(obj).__name__
    assert isinstance(session.table, ParamTable)
    assert [i.name for i in session.table.optimizer_params()] == NAMES


@pytest.mark.parametrize("cls", [base.TrainingStack, deepspeed.DeepSpeedStack, deepspeed.DeepSpeedWithoutEngine,
                                 megatron.MegatronStack], ids=lambda c: c.__name__)
def test_every_stack_adapter_declares_the_protocols_methods(cls):
    assert protocol_mismatches(cls, TrainingStack) == []
    assert isinstance(cls.name, str) and cls.name


def test_the_signature_check_sees_a_wrong_signature():
    class Wrong:
        name = "wrong"

        def optimizer_model_params(self):
            return None

        def reduced_grads(self, session, extra):  # other name, and one more without default
            return []

    problems = protocol_mismatches(Wrong, TrainingStack)
    assert "reduced_grads: parameter 0 is session (POSITIONAL_OR_KEYWORD), declared table (POSITIONAL_OR_KEYWORD)" \
        in problems
    assert "reduced_grads: extra parameter 'extra' has no default" in problems
    assert "method 'param_values' missing" in problems


def test_reduced_grads_are_the_gradients_the_optimizer_applies(tmp_path):
    model, opt, session = _session(tmp_path)
    read = []

    def before():
        read.append([(info.name, t.detach().numpy().copy()) for info, t in session.reduced_grads()])

    patch = session.install_step_hooks(before, lambda: None)
    x, y = make_batches(1)[0]
    loss_fn(model, x, y).backward()
    grads = {n: p.grad.detach().numpy().astype(np.float64) for n, p in model.named_parameters()}
    assert session.reduced_grads() and all(isinstance(i, ParamInfo) for i, _ in session.reduced_grads())
    opt.step()
    patch.remove()

    assert len(read) == 1 and [n for n, _ in read[0]] == NAMES
    for (name, g), p in zip(read[0], model.parameters()):
        np.testing.assert_array_equal(g, grads[name])
        # Adam's first moment after its first step: (1 - beta1) * the gradient it applied
        applied = opt.state[p]["exp_avg"].detach().numpy().astype(np.float64) / (1 - BETA1)
        np.testing.assert_allclose(g, applied, rtol=1e-5, atol=1e-7)
