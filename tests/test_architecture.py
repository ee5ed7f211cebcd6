"""ARCHITECTURE.md, enforced: layers, no import circles, sizes, the store's privacy.

Every import of every module under gateway/, trainer/ and sdk/ is read from its source (inside
functions too; imports under `if TYPE_CHECKING:` are types only and left out). The checks are
plain functions over that graph, so the tests at the end can show each one failing on a
planted mistake.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "trainer", "sdk")

# Bottom to top; a module may import its own layer and the ones below (ARCHITECTURE.md).
GATEWAY_LAYERS = [
    [
        "gateway.errors",
        "gateway.settings",
        "gateway.settings_scale",
        "gateway.settings_loss",
        "gateway.settings_access",
        "gateway.settings_keys",
        "gateway.settings_bounds",
        "gateway.settings_env",
        "gateway.children",
        "gateway.redact",
        "gateway.tasks",
        "gateway.devices",
    ],
    ["gateway.store", "gateway.models", "gateway.protocols", "gateway.http", "gateway.metrics"],
    [
        "gateway.engines",
        "gateway.promotion",
        "gateway.adapters",
        "gateway.pinned",
        "gateway.tracing",
        "gateway.colocate",
        "gateway.upkeep",
    ],
    ["gateway.chat", "gateway.ruler", "gateway.shadow"],
    ["gateway.routes", "gateway.ui", "gateway.openapi"],
    ["gateway.app"],
    ["gateway.cli", "gateway.flags", "gateway.demo", "gateway.export", "gateway.forget", "gateway.trainer_process"],
]
TRAINER_LAYERS = [
    ["trainer.types", "trainer.retries", "trainer.reporting"],
    ["trainer.advantages", "trainer.data", "trainer.render", "trainer.packing", "trainer.losses", "trainer.reward_kl"],
    ["trainer.backends", "trainer.checkpoints", "trainer.distributed"],
    ["trainer.step"],
    ["trainer.lock", "trainer.attempts", "trainer.selection", "trainer.resume", "trainer.publish", "trainer.sft"],
    ["trainer.worker", "trainer.follower"],
]
TRAINER_MAY_USE = [
    "gateway.errors",
    "gateway.settings",
    "gateway.children",
    "gateway.store",
    "gateway.models",
    "gateway.colocate",
]
GATEWAY_MAY_USE_TRAINER = ["gateway.cli", "gateway.demo", "gateway.export", "gateway.trainer_process"]

MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250
# Each exception is named in ARCHITECTURE.md's size table with its reason (checked below).
SIZE_EXCEPTIONS: dict[str, str] = {}


@dataclass(frozen=True)
class Module:
    name: str  # dotted, a package as its own name (gateway.store for gateway/store/__init__.py)
    path: Path
    imports: frozenset[str]  # dotted names of project modules it imports


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def read_module(name: str, path: Path, source: str, known: set[str]) -> Module:
    tree = ast.parse(source)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from gateway.store import rows` imports the module gateway.store.rows; `from
            # gateway.store import Store` the package gateway.store.
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        if _under_type_checking(node, parents):
            continue
        for target in targets:
            if target.split(".")[0] not in PACKAGES:
                continue
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                found.add(target)
    return Module(name, path, frozenset(found))


def project_modules() -> dict[str, Module]:
    paths = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            paths[dotted.removesuffix(".__init__")] = path
    known = set(paths)
    return {name: read_module(name, path, path.read_text(), known) for name, path in paths.items()}


def _layer_of(name: str, layers: list[list[str]]) -> int | None:
    for index, members in enumerate(layers):
        if any(name == m or name.startswith(m + ".") for m in members):
            return index
    return None


def _allowed(prefixes: list[str], name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def wrong_way_imports(modules: dict[str, Module]) -> list[str]:
    problems = []
    for module in modules.values():
        top = module.name.split(".")[0]
        for target in sorted(module.imports):
            target_top = target.split(".")[0]
            if top == "sdk" and target_top != "sdk":
                problems.append(f"{module.name} imports {target}: sdk stays free of gateway and trainer")
            elif top == "trainer" and target_top == "gateway" and not _allowed(TRAINER_MAY_USE, target):
                problems.append(f"{module.name} imports {target}: the trainer meets the gateway in the store only")
            elif top == "gateway" and target_top == "trainer" and not _allowed(GATEWAY_MAY_USE_TRAINER, module.name):
                problems.append(f"{module.name} imports {target}: only the commands may run the trainer")
            elif top == target_top and top in ("gateway", "trainer") and module.name != top and target != top:
                layers = GATEWAY_LAYERS if top == "gateway" else TRAINER_LAYERS
                mine, theirs = _layer_of(module.name, layers), _layer_of(target, layers)
                if mine is None:
                    problems.append(f"{module.name} is in no layer: place it in ARCHITECTURE.md and this test")
                elif theirs is not None and theirs > mine:
                    problems.append(f"{module.name} (layer {mine}) imports {target} (layer {theirs}): wrong way")
    return sorted(problems)


def import_circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for target in modules[name].imports:
            if target not in modules:
                continue
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in on_stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return circles


def oversized(path: Path, source: str) -> list[str]:
    relative = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    found = []
    lines = source.count("\n")
    if lines > MAX_MODULE_LINES and relative not in SIZE_EXCEPTIONS:
        found.append(f"{relative}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            length = node.end_lineno - node.lineno + 1
            key = f"{relative}:{node.name}"
            if length > MAX_CLASS_LINES and key not in SIZE_EXCEPTIONS:
                found.append(f"{key}: {length} lines (at most {MAX_CLASS_LINES})")
    return found


STORE_PRIVATE = re.compile(r"\bstore\._[a-z]")


def store_privacy_breaches(path: Path, source: str) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in enumerate(source.splitlines(), 1)
        if STORE_PRIVATE.search(line)
    ]


# ---------------------------------------------------------------- the checks on the codebase


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return project_modules()


def test_every_import_goes_the_right_way(modules):
    assert wrong_way_imports(modules) == []


def test_there_are_no_import_circles(modules):
    assert import_circles(modules) == []


def test_modules_and_classes_stay_small_or_are_listed_with_a_reason(modules):
    problems = [p for m in modules.values() for p in oversized(m.path, m.path.read_text())]
    assert problems == []
    note = (ROOT / "ARCHITECTURE.md").read_text()
    for exception in SIZE_EXCEPTIONS:
        assert f"`{exception}`" in note, f"{exception} is exempt from the size limits but ARCHITECTURE.md says not why"


def test_nothing_outside_the_store_package_touches_its_private_names():
    places = [ROOT / p for p in ("gateway", "trainer", "sdk", "bench", "examples")]
    breaches = []
    for place in places:
        for path in place.rglob("*.py"):
            if ROOT / "gateway" / "store" not in path.parents:
                breaches += store_privacy_breaches(path, path.read_text())
    assert breaches == []


def test_the_note_names_every_gateway_package():
    note = (ROOT / "ARCHITECTURE.md").read_text()
    packages = sorted(p.parent.name for p in (ROOT / "gateway").glob("*/__init__.py"))
    assert packages and all(f"{name}/" in note for name in packages)
    for members in GATEWAY_LAYERS:
        for member in members:
            assert f"`{member.removeprefix('gateway.')}`" in note


# ---------------------------------------------------------------- the checks can fail


def _planted(files: dict[str, str]) -> dict[str, Module]:
    known = set(files)
    return {name: read_module(name, Path(name), source, known) for name, source in files.items()}


def test_a_planted_wrong_way_import_is_caught():
    # The store (layer 1) reaching up into the chat service (layer 3), inside a function.
    modules = _planted(
        {
            "gateway.store.base": "def f():\n    from gateway.chat.service import ChatService\n",
            "gateway.chat.service": "from gateway.store.base import Store\n",
        }
    )
    assert wrong_way_imports(modules) == [
        "gateway.store.base (layer 1) imports gateway.chat.service (layer 3): wrong way"
    ]
    assert import_circles(modules) == [["gateway.chat.service", "gateway.store.base"]]


def test_the_trainer_and_the_sdk_keep_their_distance():
    modules = _planted(
        {
            "trainer.data": "from gateway.chat.identity import identify\nfrom gateway.store import Store\n",
            "sdk.client": "import gateway.errors\n",
            "gateway.routes.rl": "from trainer.data import load_groups\n",
            "gateway.chat.identity": "",
            "gateway.store": "",
            "gateway.errors": "",
        }
    )
    assert wrong_way_imports(modules) == [
        "gateway.routes.rl imports trainer.data: only the commands may run the trainer",
        "sdk.client imports gateway.errors: sdk stays free of gateway and trainer",
        "trainer.data imports gateway.chat.identity: the trainer meets the gateway in the store only",
    ]


def test_type_only_imports_do_not_count():
    modules = _planted(
        {
            "gateway.store.base": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from gateway.chat.service import ChatService\n",
            "gateway.chat.service": "",
        }
    )
    assert wrong_way_imports(modules) == []


def test_a_long_class_and_a_private_store_name_are_caught():
    source = "class Big:\n" + "    x = 1\n" * 300 + "\n" * 120
    assert oversized(Path("gateway/big.py"), source) == [
        "gateway/big.py: 421 lines (at most 400)",
        "gateway/big.py:Big: 301 lines (at most 250)",
    ]
    assert store_privacy_breaches(ROOT / "bench" / "x.py", "rows = store._query('SELECT 1')\n") == [
        "bench/x.py:1: rows = store._query('SELECT 1')"
    ]
