"""Imports between server packages go one way: down the layers below, never up or sideways.

A package may import from packages of a lower layer only; two packages of one layer (training and
sampling, say) know nothing of each other. So there are no cycles between packages either.
"""

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"

# Lowest first. A top-level module (config.py, app.py) counts as a package of its own.
LAYERS = [
    {"errors", "config", "heap"},
    {"progress", "metrics", "wire", "store", "connections", "banner"},
    {"models", "keys", "runs"},
    {"rendering", "lora"},
    {"training", "sampling", "recorded_sequences"},
    {"scheduler", "checkpoints", "adapter_imports", "merged_export"},
    {"api"},
    {"app", "direct_routes"},
    {"__main__"},
]
LAYER_OF = {package: index for index, layer in enumerate(LAYERS) for package in layer}


def _server_imports(path: Path) -> set[str]:
    """The server packages a file imports (anywhere in it: lazy imports count too)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        imported |= {name.split(".")[1] for name in names if name.startswith("server.")}
    return imported


def test_every_server_package_has_a_layer():
    packages = {path.stem for path in SERVER.glob("*.py") if path.stem != "__init__"}
    packages |= {path.name for path in SERVER.iterdir() if (path / "__init__.py").exists()}
    assert packages == set(LAYER_OF), "place a new package in LAYERS"


def test_server_packages_import_only_lower_layers():
    upward = []
    for path in SERVER.rglob("*.py"):
        if path.parent == SERVER and path.stem == "__init__":
            continue
        package = path.relative_to(SERVER).parts[0].removesuffix(".py")
        for target in _server_imports(path) - {package}:
            if LAYER_OF[target] >= LAYER_OF[package]:
                upward.append(f"{path.relative_to(SERVER.parent)} imports server.{target}")
    assert upward == []
