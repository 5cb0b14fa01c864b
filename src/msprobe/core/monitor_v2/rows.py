"""What a row of the monitor's output is: the one place that says it.

Every CSV file is ``<output_dir>/rank_<r>/<monitor>_step<a>-<b>[.run<k>].csv``; every row is
``vpp_stage, step, module_name, scope[, micro_step], <ops>``. This module holds the
monitor names in their fixed order, each monitor's scopes, the statistics (ops), the
header and the way each ``module_name`` is composed. The monitors, the config, the
writer, the alerter and the analysis reader all take them from here, so that what is
written and what is read back can never drift apart.

Framework-neutral and standard library only: the analysis tools import it without
torch or MindSpore.
"""

import re
from typing import Dict, List, Sequence, Tuple, Union

# ---------------------------------------------------------------------- monitors
MODULE = "module"
WEIGHT_GRAD = "weight_grad"
OPTIMIZER = "optimizer"
PARAM = "param"
CC = "cc"
MOE = "moe"
# The fixed order: of the config's monitors, of the files of a step, of alerts and of
# every analysis listing.
MONITORS: Tuple[str, ...] = (MODULE, WEIGHT_GRAD, OPTIMIZER, PARAM, CC, MOE)

# ------------------------------------------------------------------------ scopes
# module: the training step's forward pass, evaluation passes and generation passes
# (``generate``: a model's forward calls inside generation, prefill and decoding), each kept
# apart from the step's rows, and the backward pass.
FORWARD = "forward"
EVAL_FORWARD = "eval_forward"
GENERATE = "generate"
BACKWARD = "backward"
# weight_grad: the local gradient during backward, and the gradient at the optimizer step.
UNREDUCED = "unreduced"
REDUCED = "reduced"
# param: the values right before and right after the optimizer's update.
PARAM_ORIGIN = "param_origin"
PARAM_UPDATED = "param_updated"
# optimizer: the scope is the state's name, as PyTorch names it. These are Adam's
# moments and SGD's momentum; any other per-parameter state keeps its own name.
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
MOMENTUM_BUFFER = "momentum_buffer"
# cc: every communication call.
COMM = "comm"
# moe: the routers' decisions in the training forward (all micro-batches of a step), in
# evaluation passes (only with ``eval_routing``), and the router weight the step started from.
ROUTING = "routing"
EVAL_ROUTING = "eval_routing"
ROUTER_WEIGHT = "router_weight"

SCOPES: Dict[str, Tuple[str, ...]] = {
    MODULE: (FORWARD, EVAL_FORWARD, GENERATE, BACKWARD),
    WEIGHT_GRAD: (UNREDUCED, REDUCED),
    OPTIMIZER: (EXP_AVG, EXP_AVG_SQ, MOMENTUM_BUFFER),
    PARAM: (PARAM_ORIGIN, PARAM_UPDATED),
    CC: (COMM,),
    MOE: (ROUTING, EVAL_ROUTING, ROUTER_WEIGHT),
}
# The monitors whose files always carry ``zeros`` (moe: a count of 0 tokens is a dead expert).
ZEROS_MONITORS: Tuple[str, ...] = (MOE,)

# ------------------------------------------------------------------- scalars
# Not a monitor of the config: the values the training code or an integration hands to
# ``TrainerMonitorV2.log_scalars`` (the loss, the global gradient norm), one row per name
# and step in ``scalars_step<a>-<b>.csv``, scope ``scalars``, module_name the scalar's name,
# the default ops, no micro_step; min = max = mean = the value, norm = its absolute value.
SCALARS = "scalars"

# --------------------------------------------------------------------------- ops
# The statistics that are values, then the NaN count: the five written by default.
VALUE_OPS: Tuple[str, ...] = ("min", "max", "mean", "norm")
DEFAULT_OPS: Tuple[str, ...] = VALUE_OPS + ("nans",)
# Written only when ``ops`` names them: ``zeros`` counts the elements exactly equal to
# zero (-0.0 included, NaN not).
OPTIONAL_OPS: Tuple[str, ...] = ("zeros",)
# The order of the statistic columns in every file, whatever the order of ``ops``.
ALL_OPS: Tuple[str, ...] = DEFAULT_OPS + OPTIONAL_OPS
COUNT_OPS: Tuple[str, ...] = ("nans", "zeros")  # integer counts, written without a decimal point

# ------------------------------------------------------------------- the header
VPP_STAGE = "vpp_stage"
STEP = "step"
MODULE_NAME = "module_name"
SCOPE = "scope"
MICRO_STEP = "micro_step"  # weight_grad files only
BASE_COLUMNS: Tuple[str, ...] = (VPP_STAGE, STEP, MODULE_NAME, SCOPE)
MICRO_STEP_MONITORS: Tuple[str, ...] = (WEIGHT_GRAD,)  # the monitors whose files have micro_step
TEXT_COLUMNS: Tuple[str, ...] = (MODULE_NAME, SCOPE)


def header(ops: Sequence[str], with_micro_step: bool) -> List[str]:
    """The header of a monitor's file: the base columns, ``micro_step`` where the monitor
    has one, then its ops."""
    cols = list(BASE_COLUMNS)
    if with_micro_step:
        cols.append(MICRO_STEP)
    return cols + list(ops)


# -------------------------------------------------------------------- file names
# ``<monitor>_step<a>-<b>.csv``, or ``<monitor>_step<a>-<b>.run<k>.csv`` (k >= 2): the file of
# the same window written by another run that could not append to the plain one (its
# header differs, or another live job holds the rank directory; see writer.py). ``run`` is
# absent for the plain name (run 1).
FILE_RE = re.compile(r"^(?P<monitor>[a-z_]+)_step(?P<a>\d+)-(?P<b>\d+)(?:\.run(?P<run>[2-9]|[1-9]\d+))?\.csv$")


def file_name(monitor: str, first_step: int, last_step: int, run: int = 1) -> str:
    """The file of the window of steps ``first_step``..``last_step`` written by run series
    ``run`` (1: the plain name; ``FILE_RE`` reads both)."""
    suffix = "" if run == 1 else f".run{run}"
    return f"{monitor}_step{first_step}-{last_step}{suffix}.csv"


def file_run(match: "re.Match[str]") -> int:
    """The run series of a name ``FILE_RE`` matched (1 for the plain name)."""
    run = match.group("run")
    return 1 if run is None else int(run)


# --------------------------------------------------------------------- row names
# A parameter or module of model chunk N (a list of chunks given to start()) is ``N:name``.
CHUNK_SEP = ":"


def chunk_name(vpp_stage: int, name: str) -> str:
    """``name`` qualified by its model chunk."""
    return f"{vpp_stage}{CHUNK_SEP}{name}"


def unlisted_param_name(group: int, index: int) -> str:
    """A parameter the optimizer updates that is not part of the model given to start()."""
    return f"param_groups.{group}.params.{index}"


# weight_grad and param rows carry the parameter's (qualified) name as it is; an
# optimizer row adds the state's name.
def state_suffix(state: str) -> str:
    return f".{state}"


def optimizer_row(param_name: str, state: str) -> str:
    return param_name + state_suffix(state)


# module rows: ``<module>.<kind>.<index>``; outputs of a dict are indexed by key
# (structure.named_outputs), everything else is numbered.
INPUT = "input"
OUTPUT = "output"
GRAD_INPUT = "grad_input"
GRAD_OUTPUT = "grad_output"
MODULE_KINDS: Tuple[str, ...] = (INPUT, OUTPUT, GRAD_INPUT, GRAD_OUTPUT)


def module_prefix(tag: str, kind: str) -> str:
    """What every row of ``kind`` of the module ``tag`` starts with (before ``.<index>``)."""
    return f"{tag}.{kind}"


def module_row(tag: str, kind: str, index: Union[int, str]) -> str:
    return f"{module_prefix(tag, kind)}.{index}"


# cc rows: ``<op>.<pre|post>.<index>@<file.py>[<line>]``.
PRE = "pre"
POST = "post"


def call_site(file: str, line: int) -> str:
    """A line of code as ``cc`` names it and ``cc_codeline`` selects it: ``train.py[23]``."""
    return f"{file}[{line}]"


def cc_row(op: str, when: str, index: int, site: str) -> str:
    return f"{op}.{when}.{index}@{site}"


# moe rows: ``<router>.<kind>``, one row per router, kind and step (all micro-batches).
TOKENS_PER_EXPERT = "tokens_per_expert"
TOKEN_ENTROPY = "token_entropy"
LOGITS = "logits"
LSE = "lse"
WEIGHT_COSINE = "weight_cosine"
MOE_KINDS: Tuple[str, ...] = (TOKENS_PER_EXPERT, TOKEN_ENTROPY, LOGITS, LSE, WEIGHT_COSINE)
# the sidecar of raw counts (``"per_expert": true``): ``moe_counts_step<a>-<b>.csv``
MOE_COUNTS = "moe_counts"
MOE_COUNTS_HEADER: Tuple[str, ...] = (VPP_STAGE, STEP, MODULE_NAME, "counts")


def moe_row(router: str, kind: str) -> str:
    return f"{router}.{kind}"


def moe_router_of(name: str) -> "Tuple[str, str] | None":
    """``(router, kind)`` of a moe row name, or None for another name."""
    router, _, kind = name.rpartition(".")
    return (router, kind) if router and kind in MOE_KINDS else None


# ------------------------------------------------------------ execution order
# Where in a training step a (monitor, scope) was computed: the phase of the order key
# (analysis/order.py documents the table). It lives here, not in the analysis, because the
# training side writes the same key into ``anomalies.jsonl`` and the core never imports
# the analysis package.
LAST_MICRO = 1 << 30  # micro key of the rows read once per step, after every micro-batch

_PHASES: Dict[Tuple[str, str], int] = {
    (PARAM, PARAM_ORIGIN): 0,
    (MODULE, FORWARD): 1,
    (MODULE, EVAL_FORWARD): 1,  # evaluation passes: forward passes, in file (call) order
    (MODULE, GENERATE): 1,  # generation passes: the same
    (MODULE, BACKWARD): 2,
    (MOE, ROUTER_WEIGHT): 0,  # the router weight the step started from
    (MOE, ROUTING): 1,  # the routers' decisions in the forward pass
    (MOE, EVAL_ROUTING): 1,
    (WEIGHT_GRAD, UNREDUCED): 3,
    (WEIGHT_GRAD, REDUCED): 5,
    (PARAM, PARAM_UPDATED): 7,
}

OrderKey = Tuple[int, int, int, int, int]


def execution_phase(monitor: str, scope: str) -> int:
    """0 (parameters at step start) .. 8 (an unknown scope); see analysis/order.py."""
    p = _PHASES.get((monitor, scope))
    if p is not None:
        return p
    if monitor == OPTIMIZER:
        return 6
    if monitor == CC:
        return 4
    return 8


def execution_order(step: int, monitor: str, scope: str, micro: "int | None", line: int, rank: int) -> OrderKey:
    """``(step, micro key, phase, line, rank)``: sorting by it puts rows in the order the
    step computed them (``line``: the row's place in its file)."""
    p = execution_phase(monitor, scope)
    if p <= 2:
        mk = 0
    elif p == 3:
        mk = micro if micro is not None else LAST_MICRO
    else:
        mk = LAST_MICRO
    return (step, mk, p, line, rank)
