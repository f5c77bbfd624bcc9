"""The layout's arrows (docs/ARCHITECTURE.md's Layout): every import of the project's code, at the top of a
module or inside a function, points the way the map allows. A wrong one fails here, named with
its file and line, before it can make the trainer depend on the control plane, a Lambda on the
operator's side, or the core on anything above it.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "node", "trainfleet", "functions", "localcloud")

TRAINER_TORCH_FREE = frozenset({"trainer", "trainer.config", "trainer.schedules", "trainer.checkpoint_catalog",
                                "trainer.tokenizer", "trainer.progress", "trainer.shards", "trainer.prepare"})
"""The trainer's modules the control plane reads (the Lambda build copies them): no torch."""

PARTS = {  # a module's part: the longest of these prefixes its name starts with
    "trainer": "trainer", "node": "node", "functions": "functions", "localcloud": "localcloud",
    "trainfleet": "trainfleet", "trainfleet.core": "core", "trainfleet.adapters": "adapters",
    "trainfleet.report": "report", "trainfleet.operator": "operator", "trainfleet.cli": "cli",
}
EVERY_PART = frozenset(PARTS.values()) | {"trainer-torch-free"}

MAY_IMPORT = {
    "trainer-torch-free": {"trainer-torch-free"},
    "trainer": {"trainer", "trainer-torch-free"},
    "core": {"core", "trainer-torch-free"},
    "adapters": {"adapters", "core", "trainer-torch-free"},
    "report": {"report", "core"},
    "functions": {"functions", "core", "adapters", "report", "trainer-torch-free"},
    "node": {"node", "trainer", "trainer-torch-free", "core", "adapters"},
    "operator": {"operator", "core", "adapters", "report", "trainer", "trainer-torch-free"},
    "localcloud": EVERY_PART - {"cli"},
    "cli": EVERY_PART,
    "trainfleet": set(),
}
"""What each part may import (its own modules included)."""

LOCAL_CLOUD_SEAM = "localcloud.commands"
"""The one module of the local cloud that the `trainfleet` command imports."""

NODE_LAYERS = (
    {"node.settings", "node.node_log", "node.trainer_files", "node.gpu_health", "node.nccl_log", "node.torchrun",
     "node.standin"},
    {"node.metadata", "node.health"},
    {"node.control_plane", "node.trainer_process"},
    {"node.preflight", "node.spare", "node.attempt"},
    {"node.agent"},
)
"""The node's modules, bottom up (docs/ARCHITECTURE.md, the agent): each imports only those of the
layers below its own, so the serve loop (node.agent) is the top and nothing reaches back to it."""

TORCH_FREE_PARTS = frozenset({"trainer-torch-free", "core", "adapters", "report", "functions"})
"""Parts that Lambda runs, or that the control plane reads: torch is not there."""


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    if module in TRAINER_TORCH_FREE:
        return "trainer-torch-free"
    prefixes = [prefix for prefix in PARTS if module == prefix or module.startswith(prefix + ".")]
    return PARTS[max(prefixes, key=len)]


def imports_of(path: Path, module: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, module imported) for every import in the file, those for type annotations alone
    (under `if TYPE_CHECKING:`) too: `from pkg import name` counts as pkg.name where that is a
    module of the project."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base))
    return found


def project_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}


def import_circles(files: dict[str, Path], package: str) -> list[list[str]]:
    """The groups of `package`'s modules that import one another in a circle (each group of two or
    more sorted): the strongly connected parts of its import graph."""
    graph = {module: sorted({target for _, target in imports_of(path, module, set(files))
                             if target in files and target != package and target.split(".")[0] == package})
             for module, path in files.items() if module.split(".")[0] == package}
    order: dict[str, int] = {}
    reach: dict[str, int] = {}
    path: list[str] = []
    circles = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = reach[module] = len(order)
        path.append(module)
        for target in graph.get(module, ()):
            if target not in order:
                visit(target)
                reach[module] = min(reach[module], reach[target])
            elif target in path:
                reach[module] = min(reach[module], order[target])
        if reach[module] == order[module]:
            group = path[path.index(module):]
            del path[path.index(module):]
            if len(group) > 1:
                circles.append(sorted(group))

    for module in graph:
        if module not in order:
            visit(module)
    return sorted(circles)


def import_violations(root: Path) -> list[str]:
    """`file:line: what is wrong` for each import under `root` that the map forbids."""
    files = project_modules(root)
    # Type annotations count: a part that names the cloud it is handed cannot be read without it
    # (localcloud/parts.py says what each part needs instead).
    problems = [f"localcloud: {', '.join(circle)} import one another: the local cloud's imports point one way, "
                "cloud.py assembling the parts" for circle in import_circles(files, "localcloud")]
    for module, path in files.items():
        part = part_of(module)
        for line, target in imports_of(path, module, set(files)):
            where = f"{path.relative_to(root)}:{line}"
            top = target.split(".")[0]
            if top == "torch" and part in TORCH_FREE_PARTS:
                problems.append(f"{where}: {module} ({part}) imports torch")
            if top not in PACKAGES or target in PACKAGES:
                continue  # another package's, or a package's own __init__ (a docstring)
            wanted = part_of(target)
            if wanted not in MAY_IMPORT[part]:
                problems.append(f"{where}: {module} ({part}) may not import {target} ({wanted})")
            elif part == "cli" and top == "localcloud" and target != LOCAL_CLOUD_SEAM:
                problems.append(f"{where}: {module} reaches the local cloud only through {LOCAL_CLOUD_SEAM}, "
                                f"not {target}")
            elif part == top == "node" and not node_below(target, module):
                problems.append(f"{where}: {module} may not import {target}: a node module imports only the "
                                "layers below its own (NODE_LAYERS)")
        if part == "node" and module != "node" and node_layer(module) is None:
            problems.append(f"{path.relative_to(root)}: {module} is in no layer of NODE_LAYERS")
    return problems


def node_layer(module: str) -> int | None:
    """The layer of NODE_LAYERS a node module is in."""
    return next((layer for layer, modules in enumerate(NODE_LAYERS) if module in modules), None)


def node_below(target: str, module: str) -> bool:
    """Whether node module `target` is in a layer below `module`'s (a module in no layer is named apart)."""
    layers = node_layer(target), node_layer(module)
    return None in layers or layers[0] < layers[1]


def test_every_import_follows_the_map():
    assert import_violations(REPO) == []


def write(root: Path, module: str, source: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for folder in path.relative_to(root).parents:
        if str(folder) != ".":
            (root / folder / "__init__.py").touch()
    path.write_text(source)


@pytest.mark.parametrize("module, source, problem", [
    ("trainer.train", "from trainfleet.core.records import RunRecord\n",
     "trainer/train.py:1: trainer.train (trainer) may not import trainfleet.core.records (core)"),
    ("trainfleet.core.lifecycle.recovery", "def later():\n    from trainfleet.adapters import run_store\n",
     "trainfleet/core/lifecycle/recovery.py:2: trainfleet.core.lifecycle.recovery (core) may not import "
     "trainfleet.adapters.run_store (adapters)"),
    ("functions.report", "from trainfleet.operator.runs import Stack\n",
     "functions/report.py:1: functions.report (functions) may not import trainfleet.operator.runs (operator)"),
    ("trainfleet.cli", "from localcloud.cloud import LocalCloud\n",
     "trainfleet/cli.py:1: trainfleet.cli reaches the local cloud only through localcloud.commands, "
     "not localcloud.cloud"),
    ("trainer.schedules", "import torch\n", "trainer/schedules.py:1: trainer.schedules (trainer-torch-free) imports torch"),
    ("trainfleet.report.page", "from ..operator import live_view\n",
     "trainfleet/report/page.py:1: trainfleet.report.page (report) may not import trainfleet.operator.live_view "
     "(operator)"),
    ("node.control_plane", "from node.attempt import Attempt\n",
     "node/control_plane.py:1: node.control_plane may not import node.attempt: a node module imports only the "
     "layers below its own (NODE_LAYERS)"),
    ("node.spare", "def later():\n    from node import agent\n",
     "node/spare.py:2: node.spare may not import node.agent: a node module imports only the layers below its own "
     "(NODE_LAYERS)"),
    ("node.helpers", "", "node/helpers.py: node.helpers is in no layer of NODE_LAYERS"),
    ("localcloud.deploy", "def later():\n    from localcloud import stack\n",
     "localcloud: localcloud.deploy, localcloud.stack import one another: the local cloud's imports point one way, "
     "cloud.py assembling the parts"),
    ("localcloud.glue.ec2", "def later():\n    from localcloud.cloud import LocalCloud\n",
     "localcloud: localcloud.cloud, localcloud.glue.ec2 import one another: the local cloud's imports point one way, "
     "cloud.py assembling the parts"),
    ("localcloud.fleet",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from localcloud.cloud import LocalCloud\n",
     "localcloud: localcloud.cloud, localcloud.fleet import one another: the local cloud's imports point one way, "
     "cloud.py assembling the parts"),
])
def test_a_planted_wrong_import_is_named(tmp_path, module, source, problem):
    for allowed in ("trainfleet.core.records", "trainfleet.adapters.run_store", "trainfleet.operator.runs",
                    "trainfleet.operator.live_view", "localcloud.cloud", "localcloud.commands", "node.agent",
                    "node.attempt"):
        write(tmp_path, allowed, "")
    write(tmp_path, "trainfleet.cli", "from localcloud.commands import add_local_commands\n")
    write(tmp_path, "localcloud.stack", "from localcloud.deploy import deploy\n")
    write(tmp_path, "localcloud.cloud",
          "def assemble():\n    from localcloud.glue import ec2\n    from localcloud.fleet import LocalFleet\n")
    assert import_violations(tmp_path) == []
    write(tmp_path, module, source)
    assert import_violations(tmp_path) == [problem]
