"""The product library's boundaries, checked on its source: Triton only at the edge, no process
management, no tooling imports; each ensemble step has its module in ``serving/``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[2] / "backends" / "kvcodec"
MODULES = sorted(p for p in LIBRARY.rglob("*.py"))
# The one module allowed a process: the software HEVC decoder's own, so that a native crash or hang
# in FFmpeg is one chunk's miss, not the python stub's death (part of the fault model, not tooling).
PROCESS_OWNERS = {"bitstream/isolated.py": {"subprocess"}}


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(LIBRARY)))
def test_no_process_management_no_tooling_and_triton_only_at_the_edge(path):
    imports = _imports(path) - PROCESS_OWNERS.get(str(path.relative_to(LIBRARY)), set())
    assert not imports & {"subprocess", "signal", "multiprocessing", "perf", "kvcodec_tools", "kvcodec_client"}, imports
    if path.relative_to(LIBRARY).parts[0] != "triton":
        assert not imports & {"triton_python_backend_utils", "tritonclient"}, imports
    source = path.read_text()
    owner = str(path.relative_to(LIBRARY)) in PROCESS_OWNERS
    for call in ("os.kill", "os.killpg", "os.system", "ip netns") + (() if owner else ("Popen",)):
        assert call not in source, f"{path.name} uses {call}"


def test_each_ensemble_step_has_its_module():
    steps = {"kv_fetch": "fetch", "kv_decode": "decode", "kv_restore": "restore", "llm": "generate"}
    repo = LIBRARY.parents[1] / "model_repository"
    for step, module in steps.items():
        assert (LIBRARY / "serving" / f"{module}.py").is_file()
        text = (repo / step / "1" / "model.py").read_text()
        # the step's module, or the composition that builds it (kvcodec.compose: fetcher, decode step)
        assert f"kvcodec.serving.{module}" in text or "kvcodec.compose" in text, step


def test_the_process_owners_are_what_they_say():
    for name, allowed in PROCESS_OWNERS.items():
        assert (LIBRARY / name).is_file() and allowed <= _imports(LIBRARY / name), name


CLIENT = LIBRARY.parents[1] / "clients" / "kvcodec_client"


@pytest.mark.parametrize("path", sorted(CLIENT.rglob("*.py")), ids=lambda p: p.name)
def test_the_client_imports_nothing_of_the_tools(path):
    """Imports go one way: tools -> client -> library. A client that imports the benches is no
    longer a library someone can depend on."""
    assert not _imports(path) & {"perf", "kvcodec_tools", "subprocess"}, _imports(path)


def test_no_top_level_package_is_named_perf():
    """The tools are a package named for this project (``kvcodec_tools``), not ``perf``, a name that
    collides in users' environments."""
    root = LIBRARY.parents[1]
    assert not (root / "perf" / "__init__.py").exists()
    assert (root / "perf" / "kvcodec_tools" / "__init__.py").is_file()
    assert 'kvcodec = "kvcodec_tools.cli:main"' in (root / "pyproject.toml").read_text()


# -- no import circles -------------------------------------------------------------------------------
PACKAGES = {"kvcodec": LIBRARY, "kvcodec_tools": LIBRARY.parents[1] / "perf" / "kvcodec_tools"}
# Circles known and not yet broken, each with its reason; the test fails once one is gone (drop it here).
KNOWN_CIRCLES: set = set()


def _project_modules() -> dict:
    """{dotted name: path} of every module of the library and the tools (a package by its own name)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict:
    """{module: the project's modules it imports}, at module level and inside functions alike (a
    deferred import is still an edge: it only hides a circle until the call). ``from P import x``
    is an edge to ``P.x`` where that is a module, else to ``P``; a name outside the project is no edge."""
    modules = _project_modules()
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        deps = set()
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_the_graph_sees_the_imports_it_must():
    graph = import_graph()
    assert "kvcodec.engines.model_source" in graph["kvcodec.engines.gguf"]  # a relative import
    assert "kvcodec_tools.stubs" in graph["kvcodec_tools.watchdog"]  # an absolute one
    assert "kvcodec.store.capacity" in graph["kvcodec.store.tiered"]  # one inside a function
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_import_circles_in_the_library_or_the_tools():
    """Imports go one way, down: a circle (even through an import deferred into a function) means
    two modules that cannot be understood, tested or moved apart; break one by moving what both
    need down into a module both import."""
    found = set(circles(import_graph()))
    assert not found - KNOWN_CIRCLES, sorted(sorted(c) for c in found - KNOWN_CIRCLES)
    assert KNOWN_CIRCLES <= found, "a known circle is gone: remove it from KNOWN_CIRCLES"


TOOLS = LIBRARY.parents[1] / "perf" / "kvcodec_tools"
# The engine adapters that meet connector/: what they hold is translation between an engine's calls
# and the core (a job done for one engine only would be a job the other engine lacks).
ADAPTERS = ("engines/vllm_connector.py", "engines/trtllm_scheduler.py", "engines/trtllm_worker.py")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_over_500_lines_and_the_adapters_within_550():
    big = {str(p): _lines(p) for p in [*MODULES, *TOOLS.rglob("*.py")] if _lines(p) > 500}
    assert not big, big
    adapters = {name: _lines(LIBRARY / name) for name in ADAPTERS}
    assert sum(adapters.values()) <= 550, adapters


# The library's floors, top to bottom (docs/development/layers.md): every import from one package
# (or top-level module) of kvcodec to another goes down this list.
FLOORS = ["engines", "compose", "ingest", "triton", "serving", "connector", "encode", "layout", "bitstream",
          "settings", "store", "profiles", "registry", "format", "errors"]


def test_every_import_between_the_librarys_packages_goes_down():
    def floor(module: str) -> str:
        return module.split(".")[1] if module.count(".") else module

    graph = import_graph()
    up = sorted(f"{a} -> {b}" for a, bs in graph.items() if a.startswith("kvcodec.") for b in bs
                if b.startswith("kvcodec.") and floor(a) != floor(b)
                and FLOORS.index(floor(a)) > FLOORS.index(floor(b)))
    assert not up, up
    seen = {floor(m) for m in graph if m.startswith("kvcodec.")} - {"kvcodec"}
    assert seen <= set(FLOORS), seen - set(FLOORS)  # a new package takes its floor here and in layers.md
