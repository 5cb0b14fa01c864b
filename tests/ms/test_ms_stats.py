"""Statistics of the MindSpore engine through the monitors: NaN and Inf (the NaN is never
hidden: MindSpore's CPU min/max skip NaN), low-precision (bf16, fp16), integer, bool
and empty tensors, and subsets of ``ops``. References: NumPy in fp64 on copies."""

import math

import pytest

from support.extras import require

require("mindspore", "the MindSpore tests run its cells and optimizers (CPU)")

from support import assert_row_matches, find_row, rows_of  # noqa: E402
from support.ms_helpers import MLP, ms, nn, np, np_stats, ops, weights_of  # noqa: E402

from msprobe.core.monitor_v2.trainer import TrainerMonitorV2  # noqa: E402

NAN, INF = float("nan"), float("inf")


def test_nan_and_inf_in_params_and_gradients(tmp_path):
    """param_origin/param_updated of parameters holding NaN and/or Inf, and reduced
    gradients holding NaN/Inf (passed by hand to ``optimizer(grads)``)."""
    net = MLP()
    w = weights_of(net)
    w["fc1.weight"][0, :3] = [NAN, INF, NAN]  # NaN and Inf
    w["fc1.bias"][:2] = [INF, -INF]  # Inf of both signs, no NaN: mean nan, norm inf
    w["fc2.weight"][1, 1] = INF  # +Inf only: max, mean and norm inf
    for name, p in net.parameters_and_names():
        p.set_data(ms.Tensor(w[name]))
    opt = nn.SGD(net.trainable_params(), learning_rate=0.0)
    grads = [np.ones_like(w[n]) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    grads[0][1, 1] = NAN
    grads[2][0, 0] = -INF
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {
        "param": {"enabled": True}, "weight_grad": {"enabled": True}}}, fr="ms")
    mon.start(model=net, optimizer=opt)
    before = weights_of(net)
    opt(tuple(ms.Tensor(g) for g in grads))
    after = weights_of(net)
    mon.stop()

    rows = rows_of(out, "param")
    for name in before:
        for scope, arrays in (("param_origin", before), ("param_updated", after)):
            want = np_stats(arrays[name])
            row = find_row(rows, module_name=name, scope=scope)
            assert_row_matches(row, want)
    # spelled out for the parameter that holds NaN and Inf
    origin = find_row(rows, module_name="fc1.weight", scope="param_origin")
    assert [origin[k] for k in ("min", "max", "mean", "norm", "nans")] == ["nan", "nan", "nan", "nan", "2"]
    both = find_row(rows, module_name="fc1.bias", scope="param_origin")
    assert (both["min"], both["max"], both["mean"], both["norm"], both["nans"]) == ("-inf", "inf", "nan", "inf", "0")
    plus = find_row(rows, module_name="fc2.weight", scope="param_origin")
    assert (plus["max"], plus["mean"], plus["norm"], plus["nans"]) == ("inf", "inf", "inf", "0")
    assert math.isfinite(float(plus["min"]))

    wg = rows_of(out, "weight_grad")
    for i, name in enumerate(before):
        assert_row_matches(find_row(wg, module_name=name, scope="reduced"), np_stats(grads[i]))
    g0 = find_row(wg, module_name="fc1.weight", scope="reduced")
    assert (g0["min"], g0["max"], g0["mean"], g0["norm"], g0["nans"]) == ("nan", "nan", "nan", "nan", "1")


class Outputs(nn.Cell):
    """Returns the input in several dtypes, an empty tensor and a NaN-holding tensor."""

    def construct(self, x):
        return (x.astype(ms.bfloat16), x.astype(ms.float16), (x * 8).astype(ms.int32), x > 0,
                ops.zeros((0, 3), ms.float32), ops.zeros((0,), ms.bfloat16), x.astype(ms.float64),
                x / x)


def run_outputs(tmp_path, ops_list=None):
    # multiples of 1/8 up to 8: exact in bf16 (8 significant bits) and fp16
    x = (np.arange(-24, 24, dtype=np.float32).reshape(6, 8) / 8.0) * np.array([1, -1] * 4, np.float32)
    x[0, 0] = 7.875
    cfg = {"targets": ["Outputs"]}
    if ops_list is not None:
        cfg["ops"] = ops_list
    out = tmp_path / "out"
    mon = TrainerMonitorV2({"output_dir": str(out), "monitors": {"module": cfg}}, fr="ms")
    cell = Outputs()
    mon.start(model=cell)
    outputs = cell(ms.Tensor(x))
    assert outputs[0].dtype == ms.bfloat16 and outputs[1].dtype == ms.float16
    assert np.array_equal(outputs[0].astype(ms.float32).asnumpy(), x)  # exact, so NumPy on x is the reference
    mon.step()
    mon.stop()
    with np.errstate(invalid="ignore", divide="ignore"):
        xx = x.astype(np.float64) / x.astype(np.float64)
    want = {
        "Outputs.input.0": x, "Outputs.output.0": x, "Outputs.output.1": x,
        "Outputs.output.2": np.trunc(x * 8), "Outputs.output.3": (x > 0).astype(np.float64),
        "Outputs.output.4": np.zeros((0, 3)), "Outputs.output.5": np.zeros((0,)),
        "Outputs.output.6": x, "Outputs.output.7": xx,
    }
    return rows_of(out, "module"), want


def test_low_precision_integer_bool_empty_and_nan_outputs(tmp_path):
    rows, want = run_outputs(tmp_path)
    assert sorted(r["module_name"] for r in rows) == sorted(want)
    assert np.isnan(want["Outputs.output.7"]).sum() == 1  # 0/0
    for tag, a in want.items():
        assert_row_matches(find_row(rows, module_name=tag), np_stats(a), rtol=1e-6, atol=1e-7)
    for tag in ("Outputs.output.4", "Outputs.output.5"):  # empty: nan / 0
        r = find_row(rows, module_name=tag)
        assert (r["min"], r["max"], r["mean"], r["norm"], r["nans"]) == ("nan", "nan", "nan", "0", "0")


@pytest.mark.parametrize("ops_list", [["min", "max"], ["max"], ["mean"], ["nans"], ["min", "nans"], ["norm"]])
def test_nan_is_never_hidden_whatever_the_ops(tmp_path, ops_list):
    rows, want = run_outputs(tmp_path, ops_list)
    order = [o for o in ("min", "max", "mean", "norm", "nans") if o in ops_list]
    for r in rows:
        assert list(r)[4:] == order
        assert_row_matches(r, {k: v for k, v in np_stats(want[r["module_name"]]).items() if k in order},
                           rtol=1e-6, atol=1e-7)
    nan_row = find_row(rows, module_name="Outputs.output.7")
    for op in order:
        assert nan_row[op] == ("1" if op == "nans" else "nan"), (op, nan_row)
