"""What a platform engineer reads (README, docs/ but the developer notes in docs/development/,
deploy/): no paths of the machines this project was developed on in printed examples; every
``kvcodec repository`` command line gives the ``--variant`` the parser requires; and the NGC
container is never told to ``pip install -r requirements.txt`` (it pins the project venv's torch,
numpy and nvidia-pytriton and would replace the container's builds: docs/deploy-trtllm.md)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USER_DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "deploy").rglob("*.md")])


def test_no_machine_paths_in_user_docs():
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in USER_DOCS
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"(?<![\w.])/(root|work)/", line)]
    assert not found, found


def test_every_repository_command_names_its_variant():
    from kvcodec_tools.cli import build_parser

    build_parser().parse_args(["repository", "--variant", "cpu", "--out", "x"])  # --variant is required
    lines = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in USER_DOCS
             for m in re.finditer(r"kvcodec repository --.*", p.read_text())
             if "--variant" not in m.group(0)]
    assert not lines, lines


def test_the_ngc_container_is_never_told_to_install_requirements_txt():
    for doc in (REPO / "docs" / "deploy.md", REPO / "docs" / "deploy-trtllm.md"):
        assert "pip install -r requirements.txt" not in doc.read_text(), doc.name
