"""The package layout is the design: core (the algorithm) <- run (a job) <- measure (tools),
with the command line (its subcommands, and the parser that runs them) on top. Checked on the
source, imports inside functions included."""

import ast
import os

import pytest
from conftest import ROOT

PACKAGE = os.path.join(ROOT, "megatron_tsp")
# what each part may import from megatron_tsp (besides itself)
ALLOWED = {
    "core": {"env", "errors", "versions"},  # versions: which megatron-core release builds what
    "run": {"core", "device", "env", "errors", "versions"},
    "measure": {"core", "run", "device", "env", "errors", "versions"},
    "device": set(),
    "env": {"device"},
    "errors": set(),
    "versions": set(),
    "megatron_lm": {"core", "env", "run", "versions"},  # run: the modes' launch environment, named rewrites
    "megatron_lm_run": {"device", "megatron_lm", "run", "versions"},
    "commands": {"core", "run", "measure", "device", "env", "errors", "versions"},
    "cli": {"commands", "core", "run", "measure", "device", "env", "errors", "versions"},
    "__init__": set(),  # names only, imported lazily by string
}


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield dotted, path


def _imports(path):
    """(imported module, names taken from it, line) for every megatron_tsp import."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megatron_tsp":
            for alias in node.names:
                target = f"{node.module}.{alias.name}"  # a module, or a name in node.module
                yield (target if target in MODULES else node.module), alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "megatron_tsp":
                    yield alias.name, None, node.lineno


def _part(dotted):
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


MODULES = dict(_modules())


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers(module):
    mine = _part(module)
    bad = []
    for target, _, line in _imports(MODULES[module]):
        other = _part(target)
        if other != mine and other not in ALLOWED[mine]:
            bad.append(f"{module}:{line} imports {target}")
    assert not bad, bad


def test_no_module_is_over_700_lines():
    """A module longer than one sitting's reading holds more than one job: split it."""
    lines = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            lines[module] = sum(1 for _ in f)
    assert not {m: n for m, n in lines.items() if n > 700}


def test_no_module_takes_another_modules_private_names():
    bad = []
    for module, path in MODULES.items():
        for target, name, line in _imports(path):
            if name and name.startswith("_") and target != module:
                bad.append(f"{module}:{line} imports {target}.{name}")
        tree = ast.parse(open(path, encoding="utf-8").read())
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and n.module and n.module.startswith("megatron_tsp") for a in n.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                bad.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, bad


def test_measure_is_imported_by_the_command_line_only():
    users = {module for module, path in MODULES.items() if _part(module) != "measure"
             for target, _, _ in _imports(path) if _part(target) == "measure"}
    assert {_part(module) for module in users} <= {"cli", "commands"}, users


def test_committed_results_name_no_machines_folders():
    """A config path as this machine spelled it (the bench-cpu-link.png title carried one)."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "bench", "results")):
        for name in files:
            if name.endswith((".json", ".md", ".txt")):
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    text = f.read()
                found += [f"{name}: {marker}" for marker in (ROOT, "/tmp/", "/home/", "/root/") if marker in text]
    assert not found, found


def test_the_tiers_name_collected_tests():
    """Every test or case tests/tiers.py names is collected (a renamed test would leave the
    tier it was put in silently), and the default tier leaves something to --full."""
    import subprocess
    import sys

    import tiers

    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "--full", "-p", "no:cacheprovider"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    collected = [line for line in out.stdout.splitlines() if line.startswith("tests/")]
    assert len(collected) > 500, out.stdout[-2000:] + out.stderr[-2000:]
    unmatched = [name for name in tiers.FULL + tiers.KEEP if not any(tiers.names(name, n) for n in collected)]
    assert not unmatched, unmatched
    assert 0 < sum(tiers.tier_of(n) == "full" for n in collected) < len(collected)
