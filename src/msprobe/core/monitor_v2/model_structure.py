"""``rank_<r>/structure.txt``: the model's module and parameter names, written by
``start()`` when the config says ``"structure": true``, read by ``msprobe-monitor struct``.

Module names are listed exactly as ``monitors.module.targets`` is matched against them
(``monitor.module_tags``: the root under its class name, the ``<chunk>:`` prefix for a
list of model chunks, a module reachable under two names once, under the first), so a
name copied from the file is a target that selects that module. Parameter names are
the ``module_name`` of the ``weight_grad``, ``param`` and ``optimizer`` rows.

The file is text, one entry per line, tab-separated, so that both people and the CLI
read it: ``module<TAB>name<TAB>class<TAB>notes`` and ``param<TAB>name<TAB>dtype
shape<TAB>trainable|frozen``; lines starting with ``#`` are comments. A tab, newline or
backslash inside a name is written as ``\\t``, ``\\n``, ``\\\\``.

Nothing is written through a symbolic link: an existing link at the file's path is an
``OutputError`` naming it. The file is written whole (a temporary file renamed over it),
mode 0640.
"""

import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

from .errors import OutputError
from .safe_fs import write_all

FILE_NAME = "structure.txt"
_TITLE = re.compile(r"^# msprobe-monitor model structure: rank (?P<rank>\d+), framework (?P<fr>\w+),")
CONTAINER_NOTE = "container: never called itself, no rows of its own (its children have them)"
ROUTER_NOTE = "moe router"  # "moe router (found by ...)": the moe monitor observes it
FROZEN = "frozen"
TRAINABLE = "trainable"


def target_hits(tag: str, targets: Sequence[str]) -> List[str]:
    """The targets that select the module named ``tag``: plain substring match."""
    return [t for t in targets if t in tag]


@dataclass
class ModuleEntry:
    name: str  # exactly as targets match it
    cls: str
    container: bool = False
    depth: int = 0  # nesting level: 0 for a chunk's root
    router: str = ""  # the moe monitor's router note ("" for a module that is not one)


@dataclass
class ParamEntry:
    name: str  # exactly as weight_grad/param/optimizer rows name it
    dtype: str
    shape: Tuple[int, ...]
    trainable: bool


@dataclass
class Structure:
    framework: str = ""
    rank: int = 0
    modules: List[ModuleEntry] = field(default_factory=list)
    params: List[ParamEntry] = field(default_factory=list)

    def select(self, targets: Sequence[str]) -> List[ModuleEntry]:
        """The modules ``targets`` select, as the module monitor selects them (all for none)."""
        return [m for m in self.modules if not targets or target_hits(m.name, targets)]


def depth_of(name: str, root: bool) -> int:
    """Nesting level of a module (its name's dotted components; a chunk prefix aside)."""
    if root:
        return 0
    local = name.split(":", 1)[1] if ":" in name and name.split(":", 1)[0].isdigit() else name
    return local.count(".") + 1


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            out.append({"t": "\t", "n": "\n", "r": "\r", "\\": "\\"}.get(text[i + 1], text[i:i + 2]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def render(structure: Structure, targets: Sequence[str] = (), module_enabled: bool = False) -> str:
    modules, params = structure.modules, structure.params
    lines = [
        f"# msprobe-monitor model structure: rank {structure.rank}, framework {structure.framework}, "
        f"{len(modules)} modules, {len(params)} parameters",
        "# Module names are exactly what monitors.module.targets matches: a module is monitored when one",
        "# target is a substring of its name (no targets: every module). Parameter names are the module_name",
        "# of the weight_grad, param and optimizer rows (frozen ones have no such rows).",
        "# Count what a targets list selects: msprobe-monitor struct OUTPUT_DIR --targets NAME [NAME ...]",
    ]
    if module_enabled:
        chosen = structure.select(targets)
        lines.append(f"# This run: monitors.module.targets = {list(targets)} selects {len(chosen)} of "
                     f"{len(modules)} modules.")
    lines.append("# kind\tname\ttype\tnotes")
    for m in modules:
        notes = ["root"] if m.depth == 0 else []
        if m.container:
            notes.append(CONTAINER_NOTE)
        if m.router:
            notes.append(m.router)
        lines.append("\t".join(("module", _escape(m.name), _escape(m.cls), "; ".join(notes))))
    for p in params:
        shape = "[" + ", ".join(str(d) for d in p.shape) + "]"
        lines.append("\t".join(("param", _escape(p.name), f"{p.dtype} {shape}", TRAINABLE if p.trainable else FROZEN)))
    return "\n".join(lines) + "\n"


def write_structure(rank_dir: str, structure: Structure, targets: Sequence[str] = (),
                    module_enabled: bool = False) -> str:
    """Write ``rank_dir/structure.txt`` and return its path (see the module doc)."""
    path = os.path.join(rank_dir, FILE_NAME)
    if os.path.islink(path):
        raise OutputError(f"monitor_v2: refusing to write the model structure through the symbolic link {path!r}; "
                          f"remove the link or choose another output_dir")
    data = render(structure, targets, module_enabled).encode("utf-8", "backslashreplace")
    fd, tmp = tempfile.mkstemp(prefix=".structure.", suffix=".tmp", dir=rank_dir)
    try:
        os.fchmod(fd, 0o640)  # whatever the umask
        write_all(fd, data)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)  # replaces a link created meanwhile, never writes through it
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise OutputError(f"monitor_v2: cannot write the model structure to {path!r}: "
                          f"{exc.strerror or exc}") from None
    return path


def parse_structure(text: str, source: str = FILE_NAME) -> Structure:
    """The entries of a ``structure.txt``; a line that is not an entry is a ``ValueError``
    naming the line."""
    s = Structure()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if line.startswith("#"):
            title = _TITLE.match(line)
            if title:
                s.rank, s.framework = int(title.group("rank")), title.group("fr")
            continue
        cells = line.split("\t")
        if len(cells) != 4 or cells[0] not in ("module", "param"):
            raise ValueError(f"{source}:{lineno}: not a structure entry (expected kind, name, type and notes "
                             f"separated by tabs, kind 'module' or 'param'): {line[:120]!r}")
        kind, name, kind_type, notes = cells[0], _unescape(cells[1]), cells[2], cells[3]
        if kind == "module":
            root = notes.split(";")[0].strip() == "root"
            router = next((n.strip() for n in notes.split(";") if n.strip().startswith(ROUTER_NOTE)), "")
            s.modules.append(ModuleEntry(name, _unescape(kind_type), CONTAINER_NOTE in notes, depth_of(name, root),
                                         router))
        else:
            dtype, _, shape = kind_type.partition(" ")
            dims = tuple(int(d) for d in shape.strip("[]").split(",") if d.strip())
            s.params.append(ParamEntry(name, dtype, dims, notes.strip() == TRAINABLE))
    return s


def read_structure(path: str) -> Structure:
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_structure(f.read(), path)


def module_entries(tags: Sequence[Tuple[int, str, object]], roots: Sequence[object],
                   container_types: Tuple[type, ...]) -> List[ModuleEntry]:
    """Entries from ``monitor.module_tags`` output; ``roots`` are the chunks' root modules."""
    root_ids = {id(r) for r in roots}
    return [ModuleEntry(tag, type(m).__name__, isinstance(m, container_types) if container_types else False,
                        depth_of(tag, id(m) in root_ids)) for _vpp, tag, m in tags]

