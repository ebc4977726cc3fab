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
        assert f"kvcodec.serving.{module}" in (repo / step / "1" / "model.py").read_text()


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
