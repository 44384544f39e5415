"""The layer map of megalm/ (docs/layering.md), checked against every import of every file.

Every ``import``/``from ... import`` statement is read with ``ast`` (nothing is imported), at any
depth: module level, inside functions and classes, under ``if``/``try``; only those under
``if TYPE_CHECKING:`` are left out (they never run).  Three rules:

* a module imports modules of its own unit, or of a unit in a LOWER layer of :data:`LAYERS`
  (never a higher one, never another unit of the same layer);
* no import cycle between megalm modules (the graph of all those imports, lazy ones included);
* groups are passed, never looked up: below the entry points no module reads
  :mod:`megalm.parallel_state`'s state (only its ``ProcessGroups`` type and ``group_size`` /
  ``group_rank``, which read a group given to them);
* no megalm module names the repository's other top-level packages (``tests``, ``bench``,
  ``tools``, ``pretrain_gpt``, ...): the library does not know who uses it.

Each module belongs to the unit of the longest prefix of its dotted name in :data:`UNITS`.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(REPO, "megalm")

# The layers, lowest first.  A unit is a name for one or more module prefixes (a package, a module,
# or several modules that form one idea).  The picture with the reasons: docs/layering.md.
LAYERS: List[Tuple[str, List[str]]] = [
    ("base", ["errors", "log"]),
    ("leaves", ["device", "parallel_layout", "process_groups", "parameter_names", "tokenizers"]),
    ("runtime", ["timers", "host_transfer", "topology", "parallel_state", "fusions"]),
    ("parallel primitives", ["tensor_parallel", "pipeline_parallel"]),
    ("parameter layout", ["param_layout"]),
    ("gradient reduction", ["distributed"]),
    ("optimizers", ["optimizer"]),
    ("checkpoints", ["checkpoint"]),
    ("config", ["config"]),
    ("data", ["data"]),
    ("sequence parallel blocks", ["context_parallel"]),
    ("transformer", ["transformer"]),
    ("models", ["models", "flops"]),
    ("tools", ["presets", "conversion"]),
    ("applications", ["estimate", "inference"]),
    ("fault tolerance", ["resilience"]),
    ("entry points", ["training", "launch"]),
    ("layout search", ["planner"]),
    ("commands", ["cli"]),
]

# unit -> the module prefixes it holds (default: the unit's own name).
UNITS: Dict[str, List[str]] = {}

# TEMPORARY: imports that break the map and are being removed on other branches of issue #30.  The
# coordinator deletes each entry when the branch named lands; nothing else belongs here.
# (importing module, imported unit) -> branch removing it
ALLOWED_BREAKS: Dict[Tuple[str, str], str] = {}

# What a module below the entry points may take from megalm.parallel_state: the bundle's type and the two
# functions that read a group passed to them (pure layout arithmetic, re-exported there, too).
PARALLEL_STATE_PURE = {"ProcessGroups", "group_size", "group_rank", "compute_layout", "rank_groups", "node_split"}
# Modules that may read the process-group state: the entry points that build the bundle, and the
# launcher's teardown.  Not to move: the collective byte counter reads the layout's ranks per node (a
# fact of the layout, not a group) to count inter-node bytes, and DDP names it in one error message.
# The checkpoint package takes its groups (the model's, or groups=) and its I/O group (the async writer's).
READS_PARALLEL_STATE = {
    "megalm.parallel_state",
    "megalm.training.training",  # the Trainer's bundle before setup()
    "megalm.training.trainer_setup",  # Trainer.setup builds the bundle and the async writer's I/O group
    "megalm.training.initialize",  # initializes the layout from the config
    "megalm.launch.spawn",  # destroys a rank's layout after a call
    "megalm.cli.generate",  # a tool: builds the TP x PP layout it was asked for and passes its groups
    "megalm.planner.calibrate",  # a worker entry point under torchrun: builds and destroys its layout
    "megalm.distributed.data_parallel",  # get_ranks_per_node, in an error message
}

# Top-level names of this repository that are not the library.
OUTSIDE = ("tests", "bench", "tools", "scripts", "examples", "pretrain_gpt")


def layer_of_unit() -> Dict[str, int]:
    return {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}


def prefixes() -> Dict[str, str]:
    """module prefix -> unit."""
    out = {}
    for unit in layer_of_unit():
        for prefix in UNITS.get(unit, [f"megalm.{unit}"]):
            out[prefix] = unit
    return out


def unit_of(module: str, table: Dict[str, str]) -> str:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        unit = table.get(".".join(parts[:i]))
        if unit is not None:
            return unit
    raise KeyError(module)


def library_modules(root: str = ROOT) -> Dict[str, str]:
    """``{dotted module name: path}`` for every ``.py`` file under ``root``."""
    out = {}
    base = os.path.dirname(root)
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, base)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def import_nodes(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every import statement of ``tree`` at any depth, except under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _is_type_checking(node):
            for child in node.orelse:
                yield from import_nodes(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from import_nodes(node)


def module_imports(module: str, path: str, source: str, known: Set[str]) -> Dict[str, int]:
    """``{megalm module: first line}`` that ``module`` imports: ``from pkg import x`` names the
    submodule ``pkg.x`` when it is one, else the package ``pkg``."""
    is_package = path.endswith("__init__.py")
    out: Dict[str, int] = {}
    for node in import_nodes(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            if t in known and t != module:
                out.setdefault(t, node.lineno)
    return out


def _names_a_module(text: str) -> bool:
    return text in OUTSIDE or (text.split(".")[0] in OUTSIDE and "." in text and not set(" /") & set(text))


def outside_names(source: str, path: str) -> List[Tuple[str, int]]:
    """Imports of the repository's non-library packages, and strings naming them as modules
    (``"tests"``, ``"tests.x"``: ``importlib.import_module``, ``sys.modules`` lookups)."""
    out = []
    tree = ast.parse(source, filename=path)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _names_a_module(node.value):
            names = [node.value]
        out.extend((n, node.lineno) for n in names if n.split(".")[0] in OUTSIDE)
    return out


def import_graph(root: str = ROOT) -> Tuple[Dict[str, Dict[str, int]], Dict[str, str]]:
    modules = library_modules(root)
    known = set(modules)
    graph = {}
    for m, p in modules.items():
        with open(p, encoding="utf-8") as f:
            graph[m] = module_imports(m, p, f.read(), known)
    return graph, modules


def layer_breaks(graph: Dict[str, Dict[str, int]]) -> Dict[Tuple[str, str], str]:
    """``{(importing module, imported unit): description}`` of every import against the map."""
    table, layer = prefixes(), layer_of_unit()
    out = {}
    for m, targets in graph.items():
        if m == "megalm":  # the package's own __init__: names nothing (checked by the cycle rule only)
            continue
        mu = unit_of(m, table)
        for t, line in targets.items():
            tu = unit_of(t, table) if t != "megalm" else mu
            if tu == mu or layer[tu] < layer[mu]:
                continue
            where = "a higher layer" if layer[tu] > layer[mu] else "the same layer"
            out.setdefault((m, tu), f"{m}:{line} imports {t} ({tu}, {where} than {mu})")
    return out


def find_cycle(graph: Dict[str, Dict[str, int]]) -> List[str]:
    """One import cycle ``[a, b, ..., a]`` (depth-first), or []."""
    state: Dict[str, str] = {}
    stack: List[str] = []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                return stack[stack.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = "done"
        stack.pop()
        return []

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


@pytest.fixture(scope="module")
def graph():
    g, _ = import_graph()
    assert "megalm.config.sections" in g["megalm.config.cli"]  # the graph is really built
    return g


def test_every_module_has_a_unit_and_every_unit_a_module(graph):
    table = prefixes()
    assert all(unit_of(m, table) for m in graph if m != "megalm")
    units = {unit_of(m, table) for m in graph if m != "megalm"}
    assert units == set(layer_of_unit()), "units of the map without modules, or the reverse"


def test_imports_follow_the_layer_map(graph):
    breaks = layer_breaks(graph)
    unused = sorted(set(ALLOWED_BREAKS) - set(breaks))
    assert not unused, f"allow-listed imports no longer present (delete them from ALLOWED_BREAKS): {unused}"
    left = sorted(v for k, v in breaks.items() if k not in ALLOWED_BREAKS)
    assert not left, "imports against the layer map (docs/layering.md):\n" + "\n".join(left)


def test_no_import_cycle_at_any_depth(graph):
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def parallel_state_reads(source: str, path: str) -> List[Tuple[str, int]]:
    """``(name, line)`` of everything a module takes from megalm.parallel_state beyond the pure names:
    ``from megalm.parallel_state import x`` and ``parallel_state.x`` (any depth)."""
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.ImportFrom) and node.module == "megalm.parallel_state":
            out.extend((a.name, node.lineno) for a in node.names if a.name not in PARALLEL_STATE_PURE)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("parallel_state", "ps", "mpu")
            and node.attr not in PARALLEL_STATE_PURE
        ):
            out.append((node.attr, node.lineno))
    return out


def test_groups_are_passed_not_looked_up():
    found = []
    for m, p in library_modules().items():
        if m in READS_PARALLEL_STATE:
            continue
        with open(p, encoding="utf-8") as f:
            found.extend(f"{m}:{line} parallel_state.{name}" for name, line in parallel_state_reads(f.read(), p))
    assert not found, "process groups must be passed in, not looked up:\n" + "\n".join(found)
    unused = []
    for m in sorted(READS_PARALLEL_STATE - {"megalm.parallel_state"}):
        path = library_modules().get(m)
        if path is None:
            unused.append(m)
            continue
        with open(path, encoding="utf-8") as f:
            if not parallel_state_reads(f.read(), path):
                unused.append(m)
    assert not unused, f"READS_PARALLEL_STATE lists modules that no longer read it: {unused}"


def test_the_library_names_no_other_part_of_the_repository():
    found = []
    for m, p in library_modules().items():
        with open(p, encoding="utf-8") as f:
            found.extend(f"{m}:{line} {name}" for name, line in outside_names(f.read(), p))
    assert not found, "megalm/ imports outside the library: " + ", ".join(found)


def test_layering_page_shows_every_unit():
    with open(os.path.join(REPO, "docs", "layering.md"), encoding="utf-8") as f:
        page = f.read()
    missing = [u for u in layer_of_unit() if f"`{u}`" not in page]
    assert not missing, f"docs/layering.md does not show {missing}"


# --- the checker itself --------------------------------------------------------------------------


def test_checker_catches_upward_lazy_cyclic_and_outside_imports(tmp_path):
    pkg = tmp_path / "megalm"
    (pkg / "data").mkdir(parents=True)
    (pkg / "training").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "training" / "__init__.py").write_text("")
    # data (components) reaches up into training (entry points) inside a function: a break.
    (pkg / "data" / "batch.py").write_text("def f():\n    from megalm.training.step import g\n")
    (pkg / "data" / "typing_only.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megalm.training import step\n"
    )
    # a lazy cycle inside one unit
    (pkg / "training" / "step.py").write_text("from megalm.training import checks\nfrom megalm import errors\n")
    (pkg / "training" / "checks.py").write_text("def f():\n    from megalm.training.step import x\n")
    (pkg / "training" / "harness.py").write_text("def f():\n    import tests.support\n")
    g, _ = import_graph(str(pkg))
    assert g["megalm.training.step"] == {"megalm.training.checks": 1, "megalm.errors": 2}
    assert g["megalm.data.typing_only"] == {}
    assert list(layer_breaks(g)) == [("megalm.data.batch", "training")]
    cycle = find_cycle(g)
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == ["megalm.training.checks", "megalm.training.step"]
    source = (pkg / "training" / "harness.py").read_text()
    assert outside_names(source, "harness.py") == [("tests.support", 2)]
    assert outside_names("import importlib\nimportlib.import_module('bench.x')\n", "x.py") == [("bench.x", 2)]
    assert outside_names("ok = name.split('.')[0] in ('megalm', 'tests')\n", "x.py") == [("tests", 1)]
    assert outside_names("msg = 'see tools/convert.py and the tests'\n", "x.py") == []
    lookups = "from megalm import parallel_state\nfrom megalm.parallel_state import ProcessGroups, get_process_groups\n"
    lookups += "def f(g):\n    return parallel_state.group_size(g.tp), parallel_state.get_data_parallel_rank()\n"
    assert parallel_state_reads(lookups, "x.py") == [("get_process_groups", 2), ("get_data_parallel_rank", 4)]
