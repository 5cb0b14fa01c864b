"""What per-expert rows cost (issue 49 item 3): the ``param`` monitor's read of grouped
experts (``experts.py``) against today's read of the same tensors whole, on the CPU.

    python benchmarks/expert_norms.py [--experts E] [--hidden H] [--inter I] [--layers L]
                                      [--rounds N] [--smoke]

Qwen3-MoE-shaped experts by default (E=128, hidden 256, moe_intermediate 96:
``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, plus an attention projection per
layer), fp32. Each round times the three reads in alternating order: the tensors whole
(``"expert_params": []``), with ``.expert_norms`` (the default rule), and with the
``.expert.<e>`` rows too (``"per_expert": true``); the fastest round of each is printed
(a shared machine's load only ever adds time), with its ratio to the whole read. Real
models' expert slices are millions of elements (Qwen3-30B-A3B: ``--experts 16 --hidden
2048 --inter 768 --layers 1`` keeps the slice sizes with 16 experts)."""

import argparse
import tempfile
import time
from typing import Callable, Dict, List

import torch

from msprobe.core.monitor_v2.experts import ExpertReads
from msprobe.core.monitor_v2.frameworks.pytorch.session import TorchSession
from msprobe.core.monitor_v2.monitor import MonitorSettings
from msprobe.core.monitor_v2.stats import StatPlan


def model(experts: int, hidden: int, inter: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList()
    for _ in range(layers):
        layer = torch.nn.Module()
        layer.experts = torch.nn.Module()
        layer.experts.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden))
        layer.experts.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inter))
        layer.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        root.layers.append(layer)
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=96)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds: that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.experts, args.hidden, args.inter, args.layers, args.rounds = 4, 8, 4, 1, 2
    net = model(args.experts, args.hidden, args.inter, args.layers)
    session = TorchSession(net, None, {}, tempfile.mkdtemp(prefix="expert_norms_"))
    plan = StatPlan.from_ops(["min", "max", "mean", "norm", "nans", "zeros"])
    named = list(net.named_parameters())
    tensors = [p for _, p in named]
    keys = [(0, n, "param_origin", None) for n, _ in named]

    def reads(options: Dict[str, object]) -> ExpertReads:
        return ExpertReads(session, MonitorSettings("param", True, options=options), "param")

    variants: Dict[str, Callable[[], List]] = {}
    for label, options in (("whole tensors", {"expert_params": []}),
                           ("with expert_norms", {"expert_params": None}),
                           ("with expert_norms and per_expert rows", {"expert_params": None, "per_expert": True})):
        r = reads(options)
        variants[label] = lambda r=r: r.record_many(session.engine, tensors, plan, keys)
    times: Dict[str, List[float]] = {k: [] for k in variants}
    for n in range(args.rounds):
        order = list(variants.items())
        for label, fn in (order if n % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            session.engine.to_host(fn())
            times[label].append(time.perf_counter() - start)
            session.engine.forget()
    base = min(times["whole tensors"])
    elements = sum(t.numel() for t in tensors)
    print(f"{args.layers} layer(s) x {args.experts} experts (gate_up [{2 * args.inter}, {args.hidden}], down "
          f"[{args.hidden}, {args.inter}]): {elements / 1e6:.1f} M elements, {torch.get_num_threads()} threads, "
          f"fastest of {args.rounds} rounds")
    for label, got in times.items():
        best = min(got)
        print(f"  {label}: {best * 1e3:.2f} ms ({best / base:.2f} x)")


if __name__ == "__main__":
    main()
