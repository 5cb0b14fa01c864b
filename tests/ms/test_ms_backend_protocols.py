"""The back-end protocols (``backend.py``) on MindSpore, as ``tests/core/test_backend_protocols.py``
checks them on PyTorch: the session and its statistics engine implement every declared
member with a compatible signature, and ``reduced_grads()`` (a method, as in PyTorch)
hands out, inside the optimizer's step hooks, the gradients ``nn.Adam`` then applies
(its first moment after one step is (1 - beta1) g; NumPy on copies)."""

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support.protocols import protocol_mismatches  # noqa: E402
from support.ms_helpers import MLP, batches, ms, mse, nn, np  # noqa: E402

from msprobe.core.monitor_v2.backend import Session, StatsEngine  # noqa: E402
from msprobe.core.monitor_v2.frameworks.mindspore import Session as BackendSession  # noqa: E402
from msprobe.core.monitor_v2.frameworks.mindspore.session import MsSession  # noqa: E402
from msprobe.core.monitor_v2.param_table import ParamInfo, ParamTable  # noqa: E402

NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
BETA1 = 0.8


def _session(tmp_path):
    net = MLP()
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01, beta1=BETA1, beta2=0.95)
    return net, opt, MsSession(net, opt, {}, str(tmp_path))


def test_session_and_engine_implement_the_protocols(tmp_path):
    assert BackendSession is MsSession
    _, _, session = _session(tmp_path)
    for obj, protocol in ((session, Session), (session.engine, StatsEngine)):
        assert isinstance(obj, protocol)
        assert protocol_mismatches(obj, protocol) == [], type(obj).__name__
    assert isinstance(session.table, ParamTable)
    assert [i.name for i in session.table.optimizer_params()] == NAMES


def test_reduced_grads_are_the_gradients_the_optimizer_applies(tmp_path):
    net, opt, session = _session(tmp_path)
    read = []

    def before():
        read.append([(info, t.asnumpy().copy()) for info, t in session.reduced_grads()])

    patch = session.install_step_hooks(before, lambda: None)
    grad_fn = ms.value_and_grad(mse(net), None, opt.parameters)
    x, y = batches(1)[0]
    _, grads = grad_fn(ms.Tensor(x), ms.Tensor(y))
    passed = [g.asnumpy().astype(np.float64) for g in grads]
    assert session.reduced_grads() == []  # outside the optimizer's step: none
    opt(grads)
    assert session.reduced_grads() == []
    patch.remove()

    assert len(read) == 1 and [i.name for i, _ in read[0]] == NAMES
    assert all(isinstance(i, ParamInfo) for i, _ in read[0])
    for (info, g), given, moment in zip(read[0], passed, opt.moment1):
        np.testing.assert_array_equal(g, given)
        applied = moment.asnumpy().astype(np.float64) / (1 - BETA1)
        np.testing.assert_allclose(g, applied, rtol=1e-5, atol=1e-7)
