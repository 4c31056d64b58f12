"""The import rules of docs/architecture.md, read from the source with `ast` (every import,
lazy ones inside functions included) and, for "imports without matplotlib", checked by
importing in a fresh interpreter.

- `health/` judges one node: it imports none of `slurm/`, `bench/`, `archive/`, `report/` or
  the operations package `fleet/`.
- `site.py` (the model) imports nothing of `health/`; the check registry it validates tier
  names against is a leaf (`checks_registry`: only `errors` at run time).
- `fleet/` operates the cluster through `slurm/` and may use the checks; it imports none of
  `bench/`, `archive/`, `report/`.
- `slurm/` is the one seam to Slurm: it imports no other bluevela package but `errors`.
- `protocol/` (the in-job wire) is a leaf on the standard library (and `errors` at most);
  `runtime/` (the ranks' side) imports nothing of `launch/`.
- `archive/` is storage: no page, no analysis, no matplotlib.
- `goodput/` (the goodput record) imports only `protocol/`, `util/` and `errors` (standard
  library only); its readers `hooks/`, `archive/`, `report/` import nothing of `launch/`.
- Pages: only `report/page.py` and the `report/*_html.py` pages import matplotlib, and a page
  module imports no other page module (they share `page`). The analyses behind the pages
  (`report/fleet.py`, `report/efficiency.py`, `report/nightly.py`) import without matplotlib,
  and no analysis imports `report/page.py` or a page: it returns plain data, the formatters
  are the presentation side's (the pages and the `report/*_text.py` terminal summaries).
- `util/` is below everything: it imports no other bluevela package but `errors`.
- The node sampler (`telemetry/` but the epilog's `window.py`) runs on the standard library:
  no numpy, torch, h5py or matplotlib, and nothing of `archive/`, `fleet/`, `report/`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "bluevela"


def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _strings(node: ast.AST | None) -> list[str] | None:
    """The strings a constant expression holds: a string, or a tuple/list/set of strings."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = [_strings(e) for e in node.elts]
        if all(i is not None and len(i) == 1 for i in items):
            return [i[0] for i in items if i]
    return None


def _constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to strings: `X = "a.b"`, `X = ("a", "b")`, and for a dict of
    strings `X` (its keys) and `X.values()` (its values)."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name):
            continue
        if isinstance(value, ast.Dict):
            if any(k is None for k in value.keys):  # a `**other` entry: not a constant
                continue
            keys = _strings(ast.Tuple([k for k in value.keys if k is not None]))
            values = _strings(ast.Tuple(value.values))
            if keys is not None and values is not None:
                out[target.id], out[f"{target.id}.values()"] = keys, values
        elif (found := _strings(value)) is not None:
            out[target.id] = found
    return out


def _dynamic_imports(tree: ast.Module) -> set[str]:
    """The modules `importlib.import_module(...)` / `__import__(...)` calls name: a literal, a
    module-level constant, or a loop variable over one (`for m in MODULES:`); a name computed
    at run time is not seen (the rules below hold only for what this finds)."""
    consts = _constants(tree)

    def resolve(expr: ast.AST) -> list[str]:
        if isinstance(expr, ast.Name):
            return consts.get(expr.id, [])
        if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute)
                and isinstance(expr.func.value, ast.Name) and not expr.args):
            if expr.func.attr == "keys":
                return consts.get(expr.func.value.id, [])
            if expr.func.attr == "values":
                return consts.get(f"{expr.func.value.id}.values()", [])
        return _strings(expr) or []

    loops: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension) and isinstance(node.target, ast.Name):
            loops.setdefault(node.target.id, []).extend(resolve(node.iter))
    out: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        f = node.func
        if ((isinstance(f, ast.Attribute) and f.attr == "import_module"
             and isinstance(f.value, ast.Name) and f.value.id == "importlib")
                or (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))):
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id in loops:
                out.update(loops[arg.id])
            out.update(resolve(arg))
    return {m for m in out if m and not m.startswith(".")}


def imports(path: Path, runtime_only: bool = False, root: Path = REPO,
            is_module: Callable[[str], bool] | None = None) -> set[str]:
    """Every module `path` imports (absolute names; relative imports resolved), at any depth,
    `if TYPE_CHECKING:` blocks included unless `runtime_only`, and the modules it loads by
    name through `importlib.import_module` (`_dynamic_imports`). With `is_module`,
    `from PKG import a, b` names only `PKG.a` and `PKG.b` where both are modules (not `PKG`:
    the import graph's edge goes to the submodules)."""
    tree = ast.parse(path.read_text(), str(path))
    mod = _module(path, root)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out: set[str] = _dynamic_imports(tree)

    def visit(node: ast.AST) -> None:
        if runtime_only and isinstance(node, ast.If) and _is_type_checking(node):
            for orelse in node.orelse:
                visit(orelse)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            # `from bluevela.report import page` imports bluevela.report.page
            subs = [f"{name}.{a.name}" for a in node.names if a.name != "*"]
            if not (is_module and subs and all(is_module(n) for n in subs)):
                out.add(name)
            out.update(subs)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _files(under: str) -> list[Path]:
    root = PKG / under
    return sorted(root.rglob("*.py")) if root.is_dir() else [root]


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(under: str, forbidden: tuple[str, ...], runtime_only: bool = False,
                exempt: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in _files(under):
        if path.name in exempt:
            continue
        for name in sorted(imports(path, runtime_only)):
            if _in(name, forbidden):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    return bad


def test_the_parser_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The rules below are only as good as this reader: a lazy import inside a function, a
    relative import and a `from PKG import MODULE` all count; a TYPE_CHECKING one too unless
    only run-time imports are asked for."""
    pkg = tmp_path / "bluevela" / "health"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("from typing import TYPE_CHECKING\n"
                 "if TYPE_CHECKING:\n    from bluevela.site import Site\n"
                 "def f():\n    import bluevela.slurm.client\n"
                 "    from ..fleet import nodestate\n    from . import result\n")
    got = imports(f, root=tmp_path)
    assert {"bluevela.slurm.client", "bluevela.fleet.nodestate", "bluevela.health.result",
            "bluevela.site"} <= got
    assert "bluevela.site" not in imports(f, runtime_only=True, root=tmp_path)


def test_the_parser_sees_modules_loaded_by_name(tmp_path: Path) -> None:
    """`importlib.import_module` with a literal, a module-level constant, or a loop variable
    over a constant tuple or a dict's values counts as an import (the check registry's loader
    of the built-in checks was invisible to the rules below)."""
    f = tmp_path / "bluevela" / "x.py"
    f.parent.mkdir()
    f.write_text("import importlib\nfrom importlib import import_module\n"
                 "ONE = 'bluevela.a'\nMANY = ('bluevela.b', 'bluevela.c')\n"
                 "TABLE: dict[str, str] = {'d': 'bluevela.d'}\n"
                 "def f(name):\n    importlib.import_module('bluevela.lit')\n"
                 "    import_module(ONE)\n    importlib.import_module(name)\n"
                 "    for m in MANY:\n        importlib.import_module(m)\n"
                 "    return [import_module(v) for v in TABLE.values()]\n")
    got = {n for n in imports(f, root=tmp_path) if n.startswith("bluevela")}
    assert got == {"bluevela.lit", "bluevela.a", "bluevela.b", "bluevela.c", "bluevela.d"}


def test_health_judges_one_node_only() -> None:
    assert _violations("health", ("bluevela.slurm", "bluevela.bench", "bluevela.archive",
                                  "bluevela.report", "bluevela.fleet")) == []


def test_site_imports_no_check() -> None:
    assert _violations("site.py", ("bluevela.health",)) == []
    assert _violations("site_model.py", ("bluevela.health",)) == []
    assert _violations("site_file.py", ("bluevela.health",)) == []
    # the model imports neither its file reader nor the module that hands both out; the
    # reader builds the model and never imports `bluevela.site` back; `bluevela.site` asks
    # for the reader only when a site is loaded
    def back(name: str) -> bool:
        return name == "bluevela.site" or name.startswith("bluevela.site.")

    assert [n for n in imports(PKG / "site_model.py")
            if back(n) or _in(n, ("bluevela.site_file",))] == []
    assert [n for n in imports(PKG / "site_file.py") if back(n)] == []
    src = (PKG / "site.py").read_text()
    assert "\nfrom bluevela.site_file" not in src and "\nimport bluevela.site_file" not in src
    # the registry both import is a leaf: at run time only `errors` (it loads the built-in
    # checks by module name when asked for them)
    leaf = {n for n in imports(PKG / "checks_registry.py", runtime_only=True)
            if n.startswith("bluevela")}
    assert leaf <= {"bluevela.errors", "bluevela.errors.HealthError"}, leaf


def test_operations_stay_out_of_storage_benchmarks_and_pages() -> None:
    assert _violations("fleet", ("bluevela.bench", "bluevela.archive", "bluevela.report")) == []


def test_slurm_seam_is_a_leaf() -> None:
    """`slurm/` imports no other package of bluevela but `errors` and, for the one "printable
    line" of Slurm's free text, `protocol.names` (itself a standard-library leaf)."""
    others = tuple(f"bluevela.{p.name.removesuffix('.py')}" for p in PKG.iterdir()
                   if p.name not in ("slurm", "errors.py", "__init__.py", "__pycache__",
                                     "py.typed"))
    bad = _violations("slurm", others)
    assert [b for b in bad if not b.endswith(("bluevela.protocol.names",
                                              "bluevela.protocol.names.printable"))] == []


SLURM_COMMANDS = ("scontrol", "sbatch", "scancel", "salloc")


def _runs_slurm(path: Path) -> list[str]:
    """Argv literals in `path` that start with a Slurm command (a list or tuple whose first
    item is one of SLURM_COMMANDS)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.List | ast.Tuple) and node.elts
                and isinstance(node.elts[0], ast.Constant)
                and node.elts[0].value in SLURM_COMMANDS):
            found.append(f"{path.name}:{node.lineno} runs {node.elts[0].value}")
    return found


def test_launch_reaches_slurm_through_the_seam(tmp_path: Path) -> None:
    """launch/ runs no scontrol, sbatch, scancel or salloc itself: the supervisor's requeue
    and let-go go through `slurm/jobctl.py`, a submit through the `SlurmClient`; the grow
    (`launch/grow.py`) builds Slurm's job-expansion argv and hands it to the seam."""
    probe = tmp_path / "x.py"
    probe.write_text('import subprocess\nsubprocess.run(["scontrol", "requeue", "1"])\n')
    assert _runs_slurm(probe) == ["x.py:2 runs scontrol"]  # the reader sees one
    bad = [f for path in _files("launch") if path.name != "grow.py" for f in _runs_slurm(path)]
    assert bad == []


def test_the_job_side_runs_slurm_through_one_seam() -> None:
    """Every Slurm command of the supervisor's process goes through `slurm/command.py`
    (issue 38: bounded, retried, typed): a module of launch/ that names a Slurm command
    (squeue included), and jobctl, import no subprocess."""
    names = (*SLURM_COMMANDS, "squeue")
    bad = []
    for path in [*_files("launch"), PKG / "slurm" / "jobctl.py"]:
        tree = ast.parse(path.read_text(), str(path))
        runs = any(isinstance(n, ast.Constant) and n.value in names for n in ast.walk(tree))
        if runs and "subprocess" in imports(path):
            bad.append(str(path.relative_to(REPO)))
    assert bad == []
    assert "bluevela.slurm.command" in imports(PKG / "slurm" / "jobctl.py")


def test_step_outcomes_and_the_relaunch_policy_are_leaves() -> None:
    """`goodput/outcome.py` (how a step ended, why a node was lost) is read by the supervisor,
    the events record and the ledger: it imports nothing of bluevela. `launch/step_result.py`
    (what the supervisor makes of a step) imports only it. `launch/policy.py` decides from
    them alone: no socket, no process, no signal, no Slurm."""
    outcome = {n for n in imports(PKG / "goodput" / "outcome.py") if n.startswith("bluevela")}
    assert outcome == set()
    result = {n for n in imports(PKG / "launch" / "step_result.py") if n.startswith("bluevela")}
    assert [n for n in result if not _in(n, ("bluevela.goodput.outcome",))] == []
    policy = imports(PKG / "launch" / "policy.py")
    assert [n for n in policy if n.startswith("bluevela")
            and not _in(n, ("bluevela.goodput.outcome", "bluevela.launch.step_result",
                            "bluevela.launch.attempts"))] == []
    assert [n for n in policy if n.split(".")[0] in
            ("socket", "subprocess", "selectors", "signal", "os")] == []


# The goodput record's room (`goodput/`: its kinds, the record, its directory, the epilog's
# reading) sits below the launch side that writes it and below the readers (hooks, archive,
# report): above it only the standard-library leaves it builds on.
GOODPUT_MAY_IMPORT = ("bluevela.goodput", "bluevela.protocol", "bluevela.util",
                      "bluevela.errors")
GOODPUT_READERS = ("hooks", "archive", "report")


def test_the_goodput_record_is_a_room_below_launch_and_its_readers() -> None:
    """`goodput/` imports no other package of bluevela but `protocol`, `util` and `errors`
    (standard library only), and the record's readers (`hooks/`, `archive/`, `report/`) take
    it from there, never from `launch/` (before issue 38 the record lived in launch/, and
    report, archive and hooks pointed up into the launch side for it)."""
    bad = []
    for path in _files("goodput"):
        for name in sorted(imports(path)):
            top = name.split(".")[0]
            if (top == "bluevela" and not _in(name, GOODPUT_MAY_IMPORT)) or (
                    top != "bluevela" and top not in sys.stdlib_module_names):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == []
    for room in GOODPUT_READERS:
        assert _violations(room, ("bluevela.launch",)) == [], room


def test_util_is_a_leaf() -> None:
    others = tuple(f"bluevela.{p.name.removesuffix('.py')}" for p in PKG.iterdir()
                   if p.name not in ("util", "errors.py", "__init__.py", "__pycache__",
                                     "py.typed"))
    assert _violations("util", others) == []


def test_protocol_is_a_standard_library_leaf() -> None:
    """`protocol/` (keys, the line channel, the datagrams, names) is what the supervisor, its
    agents, the ranks and the epilog share: it imports the standard library and at most
    `errors` of bluevela, nothing else (no third-party package either)."""
    bad = []
    for path in _files("protocol"):
        for name in sorted(imports(path)):
            top = name.split(".")[0]
            ours = _in(name, ("bluevela.protocol", "bluevela.errors"))
            if (top == "bluevela" and not ours) or (top != "bluevela"
                                                     and top not in sys.stdlib_module_names):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == []


def test_runtime_imports_nothing_of_launch() -> None:
    """The training side (`runtime/`, in every rank) speaks the protocol; it imports nothing
    of the launch side (cd8e436: `runtime/heartbeat.py` imported `launch.wire` and
    `launch.events`)."""
    assert _violations("runtime", ("bluevela.launch",)) == []


def test_the_sampler_runs_on_the_standard_library() -> None:
    heavy = ("numpy", "torch", "h5py", "matplotlib", "bluevela.archive", "bluevela.fleet",
             "bluevela.report")
    assert _violations("telemetry", heavy, exempt=("window.py",)) == []


def test_archive_is_storage_only() -> None:
    assert _violations("archive", ("bluevela.report", "matplotlib", "bluevela.hooks",
                                   "bluevela.fleet")) == []


def test_only_pages_draw_and_pages_share_one_page_module() -> None:
    pages = tuple(p.name for p in (PKG / "report").glob("*_html.py"))
    assert {"nightly_html.py", "efficiency_html.py", "fleet_html.py"} <= set(pages)
    drawing = []
    for path in sorted(PKG.rglob("*.py")):
        if path.parent == PKG / "report" and (path.name == "page.py" or path.name in pages):
            continue
        drawing += [f"{path.relative_to(REPO)} imports {n}" for n in imports(path)
                    if _in(n, ("matplotlib",))]
    assert drawing == []
    for name in pages:
        others = tuple(f"bluevela.report.{p.removesuffix('.py')}" for p in pages if p != name)
        assert _violations(f"report/{name}", others) == [], name
        assert "bluevela.report.page" in imports(PKG / "report" / name), name


def test_analyses_import_no_page() -> None:
    """The report modules that are neither a page (`page.py`, `*_html.py`) nor a terminal
    summary (`*_text.py`) are analyses: none imports `report.page` or a page (cd8e436:
    `report/efficiency.py` imported `page` for its duration formatter)."""
    bad = []
    for path in sorted((PKG / "report").glob("*.py")):
        if path.name == "page.py" or path.name.endswith(("_html.py", "_text.py")):
            continue
        bad += [f"{path.relative_to(REPO)} imports {n}" for n in sorted(imports(path))
                if _in(n, ("bluevela.report.page",))
                or (n.startswith("bluevela.report.") and n.endswith("_html"))]
    assert bad == []


def test_analyses_import_without_matplotlib() -> None:
    code = ("import sys\n"
            "import bluevela.report.fleet, bluevela.report.efficiency, bluevela.report.nightly\n"
            "import bluevela.report.page, bluevela.archive.query, bluevela.bench.evaluate\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["bluevela.site", "bluevela.site_model", "bluevela.site_file",
                                    "bluevela.health.runner"])
def test_no_module_level_cycle_through_site(module: str) -> None:
    """Importing the model, or the checks' runner, first: each works on its own (no import
    cycle between the model and the checks)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=60, check=False)
    assert res.returncode == 0, res.stderr


def import_graph() -> dict[str, set[str]]:
    """bluevela's modules and, for each, the bluevela modules it imports at run time (lazy
    imports inside functions and importlib's by-name loads included, TYPE_CHECKING ones not;
    `from PKG import mod` points at `PKG.mod`; `from mod import name` at `mod`)."""
    files = {_module(p, REPO): p for p in PKG.rglob("*.py")}

    def owner(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        names = imports(path, runtime_only=True, is_module=files.__contains__)
        graph[mod] = {o for n in names if n.startswith("bluevela")
                      and (o := owner(n)) and o != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles: each strongly connected set of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_sees_lazy_and_by_name_imports(tmp_path: Path) -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        frozenset({"a", "b", "c"})]
    assert circles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    # the archive's old circle, schema -> store -> tables -> schema, was a lazy import
    assert "bluevela.archive.segment_read" in graph["bluevela.archive.store"]


def test_no_import_circle() -> None:
    """No module of bluevela imports itself back through others, lazy imports and importlib
    counted: the last circles (archive, hooks, report, slurm; issue 38) are cut, and none
    comes back."""
    found = [sorted(c) for c in circles(import_graph())]
    assert found == [], f"import circle(s): {found}"
