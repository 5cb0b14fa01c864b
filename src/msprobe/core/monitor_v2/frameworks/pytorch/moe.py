"""``moe``: the routers of a mixture-of-experts model, per router and written step.

Rows (``rows.MOE_KINDS``), one per router and step over all micro-batches of the training
forward (scope ``routing``; evaluation passes under ``eval_routing`` when asked):

- ``<router>.tokens_per_expert``: this rank's token count of each expert ``[E]``, so that
  ``min``/``max``/``mean``/``norm``/``zeros`` give the least and most loaded expert, the
  ideal load, MaxVio = max/mean - 1, CV = sqrt(max(norm^2/E - mean^2, 0))/mean and the
  dead experts;
- ``<router>.token_entropy``: each token's entropy of the routing distribution over the E
  experts (softmax of the logits; a sigmoid router's scores normalised to sum 1), with
  ``where(p > 0, p log p, 0)``;
- ``<router>.logits`` and ``<router>.lse`` (the logsumexp of each token's logits: z-loss =
  norm^2 / tokens) where the logits are observable;
- ``<router>.weight_cosine`` (scope ``router_weight``): the E(E-1)/2 cosines between the
  router weight's expert rows, as the step starts.

Finding routers, in this order: the config's ``routers`` regular expressions; the model's
own declaration (transformers 5.x: ``_can_record_outputs["router_logits"]`` names the
router class and the logits' index in its output); then modules whose name ends in
``router``, ``gate``, ``gating`` or ``wg`` whose first output has a router's signature
(an integer ``[..., k]`` index tensor, a bool ``[T, E]`` routing map, or float ``[..., E]``
logits of a Linear gate). A Linear child (``gate``/``wg``) of a router gives its logits
where the router's own output holds only post-activation scores (TorchTitan).

Nothing in a hook reads a value back: counts are a ``scatter_add_`` (indices) or a
``sum(0)`` (a routing map) into a device buffer per router and step; entropy, logsumexp
and the logits are handed to the statistics engine per micro-batch (merged on the host
with the step's other rows). Recomputed forwards (activation checkpointing, inside the
backward pass) are not counted. The monitor's own tensor work runs outside the training's
dispatch modes (``stats.outside_training_modes``).
"""

import logging
import re
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import rows
from ...logonce import LogOnce
from ...monitor import Monitor
from ...stats import Record, StatPlan
from ...writer import CountsRecord
from .compile import eager_hook
from .copies import ModuleHooks
from .stats import outside_training_modes

logger = logging.getLogger("msprobe.monitor_v2")

_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)
# the last component of a module name that the signature rule looks at (not ``*_proj``:
# those are MLP linears)
_ROUTER_NAME = re.compile(r"(?:^|[._])(router|gate|gating|wg)$")
_LOGITS_CHILDREN = ("gate", "wg", "linear", "proj")
SOFTMAX, SIGMOID = "softmax", "sigmoid"
# the experts beside a router: transformers and DeepSpeed ``experts``, TorchTitan
# ``routed_experts``, Megatron-Core ``experts`` (``local_experts`` inside)
_EXPERTS_NAMES = ("experts", "routed_experts", "local_experts")


def _int_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _local(t: Any) -> Any:
    """A DTensor's local piece (no communication: this rank's tokens are what it counts)."""
    to_local = getattr(t, "to_local", None) if isinstance(t, torch.Tensor) else None
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t


def _tensors(output: Any) -> List[torch.Tensor]:
    return [_local(t) for t in _seq(output) if isinstance(t, torch.Tensor)]


def _replicated(w: torch.Tensor) -> Optional[torch.Tensor]:
    """The router weight as a plain tensor, or None where this rank holds only a piece of
    it (a sharded DTensor: its cosines would need a collective, which the monitor never
    makes)."""
    if type(w).__name__ != "DTensor":
        return w
    placements = getattr(w, "placements", ())
    if all(type(p).__name__ == "Replicate" for p in placements):
        return w.to_local()
    return None


def _attr_int(module: torch.nn.Module, *names: str) -> Optional[int]:
    for holder in (module, getattr(module, "config", None)):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _score_of(module: torch.nn.Module) -> Optional[str]:
    """The score function a router declares: TorchTitan's ``score_func``, a config's
    ``scoring_func``; a DeepSeek-style ``e_score_correction_bias`` means sigmoid."""
    for holder in (module, getattr(module, "config", None)):
        for name in ("score_func", "scoring_func", "score_function"):
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, str) and value.lower() in (SOFTMAX, SIGMOID):
                return value.lower()
    if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
        return SIGMOID
    return None


def declared_routers(modules: Sequence[torch.nn.Module]) -> Dict[type, Tuple[int, Optional[str]]]:
    """transformers' declaration: ``{router class: (logits index, layer name filter)}`` from
    ``_can_record_outputs["router_logits"]`` of the models' classes (5.x: the router,
    index 0; 4.x: the sparse MoE block, index 1)."""
    found: Dict[type, Tuple[int, Optional[str]]] = {}
    for m in modules:
        table = getattr(type(m), "_can_record_outputs", None)
        if not isinstance(table, dict):
            continue
        entry = table.get("router_logits")
        if entry is None:
            continue
        target = getattr(entry, "target_class", entry)
        index = getattr(entry, "index", 0)
        if isinstance(target, type) and isinstance(index, int):
            found.setdefault(target, (index, getattr(entry, "layer_name", None)))
    return found


class Router:
    """One router: where its indices and logits are, what it is, and its step's buffers."""

    def __init__(self, vpp: int, tag: str, module: torch.nn.Module, source: str,
                 logits_index: Optional[int] = None) -> None:
        self.vpp = vpp
        self.tag = tag
        self.module = module
        self.source = source  # config | transformers | name
        self.logits_index = logits_index
        self.logits_child: Optional[torch.nn.Module] = None
        self.num_experts: Optional[int] = None
        self.top_k: Optional[int] = None
        self.score: Optional[str] = None
        self.experts: Optional[str] = None
        self.checked = False  # its output's signature was read (first call)
        self.count_vector = False  # it returns its counts per expert ([E] integers)
        self.cosines_read = False  # this step's weight_cosine row was made (its first training call)
        self.valid = True
        self.has_logits = False
        # the step's count buffers, by scope (made at the first call of a step)
        self.counts: Dict[str, torch.Tensor] = {}
        self.pending_logits = threading.local()  # the Linear child's output of the current call
        self.pair_index: Optional[torch.Tensor] = None

    def weight(self) -> Optional[torch.Tensor]:
        """The ``[E, H]`` router weight (the router's own, or its Linear child's)."""
        for owner in (self.module, self.logits_child):
            w = getattr(owner, "weight", None) if owner is not None else None
            if isinstance(w, torch.Tensor) and w.dim() == 2 and (self.num_experts is None
                                                                 or w.shape[0] == self.num_experts):
                return w
        return None

    def entry(self) -> Dict[str, Any]:
        """This router's entry in ``layout.json``'s ``moe``."""
        doc: Dict[str, Any] = {"num_experts": self.num_experts, "top_k": self.top_k, "score": self.score or SOFTMAX}
        if self.experts is not None:
            doc["experts"] = self.experts
        return doc


class MoeMonitor(Monitor):
    name = rows.MOE

    def attach(self) -> None:
        self.plan = StatPlan.from_ops(self.settings.ops)
        self._record = self.session.engine.record
        self._once = LogOnce()
        self._eval_routing: bool = self.settings.get("eval_routing")
        self._top_k: Optional[int] = self.settings.get("top_k")
        self._score: Optional[str] = self.settings.get("score")
        self.per_expert: bool = self.settings.get("per_expert")
        self._hooks = ModuleHooks()
        self._pass = threading.local()
        self.routers: List[Router] = find_routers(self.session.named_modules(), self.session.table.qualify,
                                                  self.settings.get("routers"))
        for router in self.routers:
            self._install(router)
        for root in self.session.roots:
            self._hooks.forward_pre(root, eager_hook(self.errors.wrap("moe pass tracking", self._enter), self),
                                    with_kwargs=True)
            self._hooks.forward(root, eager_hook(self.errors.wrap("moe pass tracking", self._leave), self),
                                always_call=True)
        if not self.routers:
            logger.warning("monitor_v2 moe: no router found (config 'routers' regexes, transformers' "
                           "_can_record_outputs[\"router_logits\"], or modules named *router/*gate/*gating/*wg "
                           "returning expert indices, a routing map or logits): no moe rows. Set "
                           "monitors.moe.routers to the router modules' names (\"structure\": true lists them)")
        # counts read by the sidecar writer: (vpp, row name, device counts) of the step
        self.step_counts: List[Tuple[int, str, torch.Tensor]] = []

    def _install(self, router: Router) -> None:
        site = f"moe router {router.tag}"
        self._hooks.forward(router.module, eager_hook(self.errors.wrap(site, lambda m, a, o: self._observe(router, o)),
                                                      self))
        for name in _LOGITS_CHILDREN:
            child = getattr(router.module, name, None)
            if isinstance(child, torch.nn.Linear):
                router.logits_child = child
                self._hooks.forward(child, eager_hook(self.errors.wrap(site, lambda m, a, o: self._child(router, o)),
                                                      self))
                break

    # ----------------------------------------------------------------- passes
    def _enter(self, module: torch.nn.Module, args: Tuple, kwargs: Dict) -> None:
        state = self._pass
        depth = getattr(state, "depth", 0)
        if depth == 0:
            # the chunk's call decides: reentrant checkpointing runs the training forward of a
            # block under no_grad, so only the outermost call's grad mode counts
            state.evaluation = (not torch.is_grad_enabled() or not module.training
                                or torch.is_inference_mode_enabled())
        state.depth = depth + 1

    def _leave(self, module: torch.nn.Module, args: Tuple, output: Any) -> None:
        state = self._pass
        state.depth = max(getattr(state, "depth", 1) - 1, 0)

    def _scope(self, router: Router) -> Optional[str]:
        state = self._pass
        if getattr(state, "depth", 0):
            evaluation = state.evaluation
        else:
            evaluation = not router.module.training or torch.is_inference_mode_enabled()
        if not evaluation:
            return rows.ROUTING
        return rows.EVAL_ROUTING if self._eval_routing else None

    # ------------------------------------------------------------------ hooks
    def _child(self, router: Router, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            router.pending_logits.value = output

    def _observe(self, router: Router, output: Any) -> None:
        child_logits = getattr(router.pending_logits, "value", None)
        router.pending_logits.value = None
        if _current_autograd_node() is not None:
            return  # a recomputed forward inside the backward pass (activation checkpointing)
        scope = self._scope(router)
        if scope is None or not router.valid:
            return
        tensors = _tensors(output)
        if not router.checked:
            self._check(router, output, tensors, child_logits)
            if not router.valid:
                return
        if scope == rows.ROUTING and not router.cosines_read:
            # the weight as the step started (no update has run yet), read in its first call:
            # under FSDP2 the weight is whole here, a shard between steps
            router.cosines_read = True
            self._weight_cosines(router)
        self._read(router, scope, output, tensors, child_logits)

    def _check(self, router: Router, output: Any, tensors: List[torch.Tensor],
               child_logits: Optional[torch.Tensor]) -> None:
        """The first call: where the indices and logits are, E, k and the score function."""
        router.checked = True
        module = router.module
        maps = [t for t in tensors if t.dtype == torch.bool and t.dim() >= 2]
        weight = getattr(module, "weight", None)
        E = _attr_int(module, "num_experts", "num_local_experts", "n_routed_experts")
        if E is None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            E = int(weight.shape[0])
        if E is None and router.logits_child is not None:
            E = int(router.logits_child.out_features)
        if E is None and maps:
            E = int(maps[0].shape[-1])
        floats = [t for t in tensors if t.is_floating_point() and t.dim() >= 1]
        if E is None and router.logits_index is not None and router.logits_index < len(_seq(output)):
            cand = _seq(output)[router.logits_index]
            if isinstance(cand, torch.Tensor):
                E = int(cand.shape[-1])
        if E is None and len(tensors) == 1 and floats:  # a Linear gate: its output is the logits
            E = int(floats[0].shape[-1])
        if E is None:
            router.valid = False
            self._once.warning(("no-signature", router.tag),
                               "monitor_v2 moe: %s (%s) does not look like a router (no expert count: no "
                               "[E, H] weight, routing map or num_experts); it is not observed", router.tag,
                               type(module).__name__)
            return
        router.num_experts = E
        # a 1-D integer [E] output is a ready count vector (DeepSpeed's exp_counts); indices
        # have a k dimension ([T, k], [B, L, k])
        indices = [t for t in tensors if _int_tensor(t) and t.dim() >= 2]
        router.count_vector = not indices and any(_int_tensor(t) and tuple(t.shape) == (E,) for t in tensors)
        # logits: the declared index; else a Linear child's output; else a float [.., E]
        # output of a module that computes them itself (a 2-D [E, H] weight) or is a gate
        if router.logits_index is not None:
            router.has_logits = True
        elif child_logits is not None and child_logits.shape[-1] == E:
            router.has_logits = True
        elif not maps and any(t.shape[-1] == E for t in floats) and (
                (isinstance(weight, torch.Tensor) and weight.dim() == 2) or len(tensors) == 1):
            router.logits_index = next(i for i, t in enumerate(_seq(output))
                                       if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1
                                       and t.shape[-1] == E)
            router.has_logits = True
        if indices:
            router.top_k = int(indices[-1].shape[-1])
        elif maps:
            router.top_k = self._top_k or _attr_int(module, "top_k", "num_experts_per_tok", "topk")
        else:
            router.top_k = self._top_k or _attr_int(module, "top_k", "num_experts_per_tok", "topk") or \
                self._parent_top_k(router)
        router.score = self._score or _score_of(module) or SOFTMAX
        if router.source == "name" and (E < 2 or (not indices and not maps and not router.count_vector
                                                   and router.top_k is None)):
            # a module named like a gate whose output is only a float tensor, with no top-k to
            # route by (a gated MLP's or attention's gate): not taken for a router
            router.valid = False
            self._once.warning(("not-a-router", router.tag),
                               "monitor_v2 moe: %s (%s) is named like a router but returns no expert indices, "
                               "routing map or counts, and no top_k is known for it: not observed (set "
                               "monitors.moe.routers and top_k to observe it)", router.tag, type(module).__name__)
            return
        if not indices and not maps and not router.count_vector and router.top_k is None:
            self._once.warning(("no-counts", router.tag),
                               "monitor_v2 moe: %s returns neither expert indices nor a routing map, and its top-k "
                               "is not known (set monitors.moe.top_k): no tokens_per_expert row for it",
                               router.tag)
        if not router.has_logits:
            self._once.warning(("no-logits", router.tag),
                               "monitor_v2 moe: the logits of %s (%s) are not observable (its output holds no "
                               "pre-activation [.., %d] tensor and it has no Linear gate child): no logits, lse "
                               "and token_entropy rows for it", router.tag, type(module).__name__, E)
        router.experts = self._experts_of(router)

    def _parent_top_k(self, router: Router) -> Optional[int]:
        parent_name = router.tag.rpartition(".")[0]
        for vpp, tag, m in self.session.named_modules():
            if self.session.table.qualify(vpp, tag) == parent_name:
                return _attr_int(m, "top_k", "num_experts_per_tok", "topk")
        return None

    def _experts_of(self, router: Router) -> Optional[str]:
        parent = router.tag.rpartition(".")[0]
        names = [f"{parent}.{n}" if parent else n for n in _EXPERTS_NAMES]
        tags = {self.session.table.qualify(vpp, tag) for vpp, tag, _m in self.session.named_modules()}
        return next((n for n in names if n in tags), None)

    @outside_training_modes
    def _read(self, router: Router, scope: str, output: Any, tensors: List[torch.Tensor],
              child_logits: Optional[torch.Tensor]) -> None:
        E = router.num_experts
        with torch.no_grad():
            logits: Optional[torch.Tensor] = None
            if router.logits_index is not None:
                seq = _seq(output)
                cand = _local(seq[router.logits_index]) if router.logits_index < len(seq) else None
                if isinstance(cand, torch.Tensor) and cand.shape[-1] == E:
                    logits = cand
            elif child_logits is not None and child_logits.shape[-1] == E:
                logits = _local(child_logits)
            indices = [t for t in tensors if _int_tensor(t) and t.dim() >= 2]
            maps = [t for t in tensors if t.dtype == torch.bool and t.dim() >= 2 and t.shape[-1] == E]
            ready = [t for t in tensors if _int_tensor(t) and tuple(t.shape) == (E,)] if router.count_vector else []
            counts = router.counts.get(scope)
            if counts is None:
                device = (indices or maps or tensors)[0].device
                counts = router.counts[scope] = torch.zeros(E, dtype=torch.float32, device=device)
            if indices:
                _count_indices(counts, indices[-1], E)
            elif ready:
                counts.add_(ready[0].to(torch.float32))
            elif maps:
                counts.add_(maps[0].reshape(-1, E).sum(0, dtype=torch.float32))
            elif logits is not None and router.top_k is not None:
                _count_indices(counts, torch.topk(logits.reshape(-1, E), router.top_k, dim=-1).indices, E)
            if logits is None:
                return
            flat = logits.reshape(-1, E)
            wide = flat.float()
            if router.score == SIGMOID:
                s = torch.sigmoid(wide)
                p = s / s.sum(-1, keepdim=True)
                entropy = 0.0 - torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1)
            else:
                logp = torch.log_softmax(wide, -1)
                p = logp.exp()
                # 0 - sum, not -sum: a token all on one expert has entropy +0, never -0
                entropy = 0.0 - torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
            lse = torch.logsumexp(wide, -1)
            vpp, tag, record, plan, out = router.vpp, router.tag, self._record, self.plan, self._records
            out.append(record(entropy, plan, vpp, rows.moe_row(tag, rows.TOKEN_ENTROPY), scope))
            out.append(record(flat, plan, vpp, rows.moe_row(tag, rows.LOGITS), scope))
            out.append(record(lse, plan, vpp, rows.moe_row(tag, rows.LSE), scope))

    # ------------------------------------------------------------------- steps
    def begin_step(self, step: int, active: bool) -> None:
        super().begin_step(step, active)
        for router in self.routers:
            router.counts = {}
        self.step_counts = []
        for router in self.routers:
            router.cosines_read = False

    @outside_training_modes
    def _weight_cosines(self, router: Router) -> None:
        """The pairwise cosines of the router weight's expert rows."""
        with torch.no_grad():
            w = router.weight()
            if w is None or w.shape[0] < 2 or w.device.type == "meta":
                return
            w = _replicated(w)
            if w is None:
                self._once.warning(("sharded-weight", router.tag),
                                   "monitor_v2 moe: the weight of %s is sharded in its forward (a DTensor of "
                                   "placements other than Replicate): no weight_cosine row for it (its cosines "
                                   "would need a collective)", router.tag)
                return
            E = int(w.shape[0])
            if router.pair_index is None or router.pair_index.device != w.device:
                router.pair_index = torch.triu_indices(E, E, 1, device=w.device)
            rows_ = w.detach().float()
            unit = rows_ / rows_.norm(dim=1, keepdim=True).clamp_min(1e-12)
            cos = (unit @ unit.T)[router.pair_index[0], router.pair_index[1]]
            self._records.append(self._record(cos, self.plan, router.vpp,
                                              rows.moe_row(router.tag, rows.WEIGHT_COSINE), rows.ROUTER_WEIGHT))

    def collect(self) -> List[Record]:
        if self.active:
            for router in self.routers:
                for scope, counts in router.counts.items():
                    name = rows.moe_row(router.tag, rows.TOKENS_PER_EXPERT)
                    self._records.append(self._record(counts, self.plan, router.vpp, name, scope))
                    if self.per_expert and scope == rows.ROUTING:
                        self.step_counts.append((router.vpp, name, counts))
                router.counts = {}
        return super().collect()

    def sidecar(self) -> List[CountsRecord]:
        """``"per_expert": true``: the step's raw counts per router, copied to the host
        without blocking (pinned memory and an event on an accelerator; the writer waits
        for it where it formats the row), for ``moe_counts_step<a>-<b>.csv``."""
        taken, self.step_counts = self.step_counts, []
        if not self.per_expert or not taken:
            return []
        out: List[CountsRecord] = []
        with torch.no_grad():
            for vpp, name, counts in taken:
                out.append(_host_copy(vpp, name, counts))
        return out

    def structure_notes(self) -> Dict[str, str]:
        """structure.txt's note of each router: how it was found (found again here: the
        structure is written before the monitors attach)."""
        found = find_routers(self.session.named_modules(), self.session.table.qualify, self.settings.get("routers"))
        why = {"config": "monitors.moe.routers", "transformers": "transformers' _can_record_outputs",
               "name": "its name; its output is checked at its first call"}
        return {r.tag: f"moe router (found by {why[r.source]})" for r in found}

    def layout(self) -> Dict[str, Any]:
        """``layout.json``'s ``moe``: each router found so far, by row prefix."""
        return {r.tag: r.entry() for r in self.routers if r.checked and r.valid}

    def detach(self) -> None:
        self._hooks.remove()
        for router in self.routers:
            router.counts = {}


@outside_training_modes
def _host_copy(vpp: int, name: str, counts: torch.Tensor) -> CountsRecord:
    if counts.device.type == "cpu":
        return CountsRecord(vpp, name, counts.clone())
    try:
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        event = torch.cuda.Event() if counts.device.type == "cuda" else torch.Event(device=counts.device)
        event.record()
        return CountsRecord(vpp, name, host, event)
    except Exception:  # noqa: BLE001 - a device without pinned memory or events: a plain copy
        return CountsRecord(vpp, name, counts.cpu())


def _seq(output: Any) -> Sequence[Any]:
    return output if isinstance(output, (tuple, list)) else (output,)


def _count_indices(counts: torch.Tensor, indices: torch.Tensor, E: int) -> None:
    """``counts[i] += 1`` for every index, on the device: an index outside [0, E) (a
    dropped token's -1) adds nothing, with no value read back (clamped, weight 0)."""
    flat = indices.reshape(-1)
    valid = ((flat >= 0) & (flat < E)).to(counts.dtype)
    counts.scatter_add_(0, flat.clamp(0, E - 1).to(torch.int64), valid)


def find_routers(named: List[Tuple[int, str, torch.nn.Module]], qualify: Any,
                 patterns: Sequence[str] = ()) -> List[Router]:
    """The routers of the model, in module order: config regexes, then transformers'
    declaration, then the name rule (its signature is checked at the first call)."""
    compiled = [re.compile(p) for p in patterns]
    declared = declared_routers([m for _, _, m in named])
    found: List[Router] = []
    seen = set()
    for vpp, name, module in named:
        if id(module) in seen:
            continue
        tag = qualify(vpp, name)
        if compiled:
            if any(p.search(tag) for p in compiled):
                seen.add(id(module))
                found.append(Router(vpp, tag, module, "config"))
            continue
        hit = next(((cls, spec) for cls, spec in declared.items() if type(module) is cls), None)
        if hit is not None and (hit[1][1] is None or hit[1][1] in tag):
            seen.add(id(module))
            found.append(Router(vpp, tag, module, "transformers", logits_index=hit[1][0]))
            continue
        if not declared and _ROUTER_NAME.search(name.rpartition(".")[2]):
            seen.add(id(module))
            found.append(Router(vpp, tag, module, "name"))
    # a gate inside a router found by name is its logits, not a router of its own
    by_tag = {r.tag for r in found}
    return [r for r in found if r.source != "name" or r.tag.rpartition(".")[0] not in by_tag]
