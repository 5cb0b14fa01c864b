"""``rank_<r>/layout.json``: where this rank sits in the parallel layout, and what part of
each monitored tensor its rows describe. Written once by ``start()``; read by
``msprobe-monitor merge`` (analysis/merge.py), which combines the ranks' rows into the
statistics of whole tensors under global names.

Framework-neutral and standard library only. The back ends build the document
(``Session.layout()``, with the training stack's ``TrainingStack.layout(table)``); this
module defines its shape, checks it, writes it and reads it back.

The document (JSON, one object; keys not listed here are ignored by readers)::

    {
      "format": "msprobe-monitor-layout", "version": 1,
      "framework": "pytorch", "stack": "megatron",     # TrainingStack.name
      "rank": 3, "world_size": 4,
      "groups": {                                       # this rank's coordinates
        "dp": {"rank": 1, "size": 2},                   # the group gradients are reduced over
        "tp": {"rank": 1, "size": 2},
        "pp": {"rank": 0, "size": 1}
      },                                                # a group the stack does not expose is absent;
                                                        # "dp" is always present
      "chunks": [{"vpp_stage": 0, "layer_offset": 2, "layers": 2}],   # or "unknown"
      "rename": [["0:decoder.layers.0.", "decoder.layers.2."], ["0:", ""]],
      "params": {
        "<row name as the CSV writes it>": {
          "shape": [128, 64],                           # the full tensor's shape, or "unknown"
          "pieces": {                                   # per scope class (SCOPE_CLASSES)
            "unreduced": {"numel": 4096, "split": [["tp", 1, 2]]},
            "reduced":   {"numel": 2048, "split": [["tp", 1, 2], ["dp", 1, 2]]},
            "param":     ...,
            "optimizer": ...
          }
        }
      },
      "modules": {"<module row name>": {"split": [["tp", 1, 2]]}},
      "moe": {"<router module>": {                      # mixtures of experts, where known
        "num_experts": 8, "top_k": 2, "score": "softmax", "experts": "<experts module>",
        "expert_params": ["<row name>", ...],           # the experts' parameters on this rank
        "local_experts": [4, 4],                         # [first global index, count] on this rank
        "tokens": {"split": [["dp", 1, 2]], "partial": true}   # its token counts: a part of a sum
      }},
      "unknown": ["why something above is missing", ...],
      "dtypes": {"<row name>": "bfloat16", ...}
    }

``dtypes`` gives the dtype of the tensors rows describe, by row name as the CSV writes it
(``DTYPES``: ``float32``, ``bfloat16``, ``float16``, ...): each parameter's (the model's
parameter, whatever its gradients or an optimizer's master copy are kept in), read at
``start()``, and each ``module`` row's tensor, noted when the row is first read (the first
written step; PyTorch), after which the file is written again. ``msprobe-monitor compare``
reads it to choose tolerances; the other readers ignore it.

A **piece** is the part of the full tensor that one rank's row describes: ``numel`` is
its element count and ``split`` lists the groups along which the full tensor is cut,
as ``[group, index, count]``: this piece is part ``index`` of ``count`` (pieces may be
unequal, ranges of a flattened tensor, and some ranks may hold none: they write no
row). Every group of ``groups`` not named in ``split`` is a *replica* dimension: the
ranks that differ only there hold the same piece, and for the scopes that must agree
(``reduced``, ``param``, ``optimizer``) their values must be equal. A piece may instead
be ``{"partial": true, ...}``: the full tensor is a sum over the split groups (a
sequence-parallel norm's local gradient), not combinable from statistics; or the string
``"unknown"``: the stack did not say. The merge never guesses: a row whose piece is
unknown or partial, or whose pieces do not add up to the full tensor, is left out of the
merged view and counted in its report.

``rename`` maps row-name prefixes to global ones, longest prefix first, each ending at
a separator (``.`` or the chunk separator ``:``): under pipeline parallelism a stage's
``decoder.layers.0.`` is the model's ``decoder.layers.<offset>.`` and a chunk prefix
``N:`` goes. ``chunks`` gives each model chunk's first global layer (0-based) and its
layer count; with ``groups.pp`` it orders the stages' rows in execution order.

``modules`` names module rows (``<module>.<kind>.<index>``) whose tensor is cut evenly
along the split groups (Megatron's column-parallel outputs, row-parallel inputs), or
every row of one module at once as ``<module>.*`` (``every_row``; a row's own entry comes
first). A module row named by neither is described by ``"module_default"`` when the
document has it (a stack that cannot tell which activations are replicated writes
``"unknown"`` there), else it is taken for a replica over every group but ``dp``; where
such replicas differ, the merge leaves the row out as unknown (an activation sharded or
summed in a way the stack did not name) rather than report a disagreement.
"""

import json
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import rows
from .errors import OutputError
from .safe_fs import replace_file

FILE_NAME = "layout.json"
FORMAT = "msprobe-monitor-layout"
VERSION = 1
UNKNOWN = "unknown"

# The group whose ranks hold data-parallel replicas: the one gradients are reduced over.
DP = "dp"
TP = "tp"
PP = "pp"
CP = "cp"
EP = "ep"

# Scope classes: the scopes whose rows describe the same kind of local tensor.
UNREDUCED = "unreduced"
REDUCED = "reduced"
PARAM = "param"
OPTIMIZER = "optimizer"
SCOPE_CLASSES: Tuple[str, ...] = (UNREDUCED, REDUCED, PARAM, OPTIMIZER)

# The scopes whose rows differ per data-parallel rank by design: merged per dp rank.
PER_DP_SCOPES = frozenset({rows.UNREDUCED, rows.FORWARD, rows.EVAL_FORWARD, rows.GENERATE, rows.BACKWARD})

Split = List[List[Any]]  # [[group, index, count], ...]


DTYPES = "dtypes"


def dtype_name(dtype: Any) -> str:
    """A framework's dtype as ``dtypes`` names it: ``torch.bfloat16`` and MindSpore's
    ``BFloat16`` are both ``bfloat16``."""
    return str(dtype).rsplit(".", 1)[-1].lower()


def moe_entry(doc: Dict[str, Any], router: str) -> Dict[str, Any]:
    """The ``moe`` entry of the router ``router`` (made empty where there is none): the
    router's own fields and the experts' are filled by whoever knows them."""
    return doc.setdefault("moe", {}).setdefault(router, {})


def every_row(module_tag: str) -> str:
    """The ``modules`` key that describes every row of the module ``module_tag``."""
    return module_tag + ".*"


# What a module row described by nothing in the document is: a replica over every group
# but dp, assumed (the merge leaves it out where its replicas differ).
IMPLICIT_REPLICA: Dict[str, Any] = {"split": []}


def module_entry(doc: Mapping[str, Any], row_name: str) -> Any:
    """The piece of a module row (its own entry, its module's ``<module>.*``, the
    document's ``module_default``, else ``IMPLICIT_REPLICA``)."""
    modules = doc.get("modules") or {}
    entry = modules.get(row_name)
    if entry is None:
        tag = row_name.rsplit(".", 2)[0]
        entry = modules.get(every_row(tag))
    if entry is None:
        entry = doc.get("module_default", IMPLICIT_REPLICA)
    return entry


def scope_class(monitor: str, scope: str) -> Optional[str]:
    """The piece a (monitor, scope) row describes; None for module and cc rows."""
    if monitor == rows.WEIGHT_GRAD:
        return UNREDUCED if scope == rows.UNREDUCED else REDUCED
    if monitor == rows.PARAM:
        return PARAM
    if monitor == rows.OPTIMIZER:
        return OPTIMIZER
    return None


def param_of_row(monitor: str, module_name: str, scope: str) -> str:
    """The parameter a ``weight_grad``/``param``/``optimizer`` row is of (an optimizer
    row's name ends with ``.<state>``)."""
    module_name = expert_base(module_name)
    if monitor == rows.OPTIMIZER:
        suffix = rows.state_suffix(scope)
        if module_name.endswith(suffix):
            return module_name[: -len(suffix)]
    return module_name


def expert_base(name: str) -> str:
    """The tensor row a per-expert row (``<row>.expert_norms``, ``<row>.expert.<e>``:
    ``experts.py``) is of; any other name as it is."""
    from .experts import split_row_name

    return split_row_name(name)[0]


def piece(numel: int, split: Iterable[Sequence[Any]] = (), partial: bool = False) -> Dict[str, Any]:
    """A piece descriptor (see the module doc)."""
    out: Dict[str, Any] = {"numel": int(numel), "split": [[str(g), int(i), int(n)] for g, i, n in split]}
    if partial:
        out["partial"] = True
    return out


def group(rank: int, size: int) -> Dict[str, int]:
    return {"rank": int(rank), "size": int(size)}


def new_document(framework: str, stack: str, rank: int, world_size: int) -> Dict[str, Any]:
    """The document's fixed part; a back end fills in groups, chunks, rename, params."""
    return {
        "format": FORMAT, "version": VERSION, "framework": framework, "stack": stack,
        "rank": int(rank), "world_size": int(world_size),
        "groups": {DP: group(rank, world_size)},
        "chunks": UNKNOWN, "rename": [], "params": {}, "modules": {}, "unknown": [],
    }


def rename(name: str, rules: Sequence[Sequence[str]]) -> str:
    """``name`` under the first (longest) matching prefix rule."""
    for local, global_ in rules:
        if name.startswith(local):
            return global_ + name[len(local):]
    return name


def validate(doc: Any, source: str = FILE_NAME) -> Dict[str, Any]:
    """``doc`` if it is a layout document this version reads; ``ValueError`` naming what is wrong."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{source}: not a msprobe-monitor layout (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise ValueError(f"{source}: layout version {doc.get('version')!r}, this version reads {VERSION}")
    for key, kind in (("rank", int), ("world_size", int), ("groups", dict), ("params", dict)):
        if not isinstance(doc.get(key), kind):
            raise ValueError(f"{source}: \"{key}\" must be {kind.__name__}, got {doc.get(key)!r}")
    if DP not in doc["groups"]:
        raise ValueError(f"{source}: \"groups\" has no \"{DP}\"")
    return doc


def write_layout(rank_dir: str, doc: Union[Mapping[str, Any], str]) -> str:
    """Write ``rank_dir/layout.json`` whole (a temporary file renamed over it, 0640, never
    through a link) and return its path; ``doc`` may be ``render``'s text already."""
    path = os.path.join(rank_dir, FILE_NAME)
    data = (doc if isinstance(doc, str) else render(doc)).encode("utf-8")
    try:
        with replace_file(path) as fh:
            fh.write(data)
    except OSError as exc:
        raise OutputError(f"monitor_v2: cannot write the parallel layout to {path!r}: {exc.strerror or exc}") from None
    return path


_COMPACT = json.JSONEncoder(separators=(",", ":"))


def render(doc: Mapping[str, Any]) -> str:
    """JSON with one top-level key, one parameter and one module per line: small for
    10,000 parameters, and readable with ``grep``."""
    dump = _COMPACT.encode  # one encoder: json.dumps with separators makes one per call
    lines = []
    for key, value in doc.items():
        if key in ("params", "modules", DTYPES) and isinstance(value, dict) and value:
            inner = ",\n".join(f"  {dump(k)}:{dump(v)}" for k, v in value.items())
            lines.append(f" {dump(key)}:{{\n{inner}\n }}")
        else:
            lines.append(f" {dump(key)}:{dump(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def load_layout(path: str) -> Dict[str, Any]:
    """Read and check one rank's layout (``ValueError`` naming the file and the problem)."""
    from .safe_fs import read_regular_file

    data = read_regular_file(path, 256 << 20, "layout file")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    return validate(doc, path)
