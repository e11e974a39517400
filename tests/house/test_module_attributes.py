"""No code outside modelling/ sets an attribute on a model's module: what a module runs (its
attention kernel, its recompute) is given when it is built (docs/design.md, "Layout of the code":
attention's kernel). Checked twice: on the source, for every assignment to an attribute a modelling
module has, and at run time, for every attribute set on a modelling module while an engine is
built and steps and while planning measures a layer."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from execution.engine.phases.recompute import kept_layer_on_meta
from execution.parallel.mesh import ParallelLayout
from modelling.gpt import GPTShapes
from tests.distributed import CPU, global_batches, planned_engine, replica_batch
from tests.library_files import library_files
from tests.reference import small_config

ROOT = Path(__file__).resolve().parents[2]
MODELLING = ROOT / "modelling"
OWN = ("self", "cls", "ctx")  # what code sets on its own objects
# The plain PyTorch loop a step is compared against: it checkpoints its layers the way
# PyTorch users do, by wrapping them in its own model, which the engine never runs.
BASELINES = "benchmarks/baselines.py"


def _module_attributes() -> set[str]:
    """Every attribute a module class of modelling/ sets on itself (``self.x = ...``) or
    defines (its methods and class attributes)."""
    classes: dict[str, ast.ClassDef] = {}
    for path in MODELLING.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
    modules = {"Module"}
    grown = True
    while grown:  # subclasses of subclasses of nn.Module, defined anywhere in modelling/
        found = {
            name
            for name, node in classes.items()
            if any(ast.unparse(base).split(".")[-1] in modules for base in node.bases)
        }
        grown = not found <= modules
        modules |= found
    names = set()
    for name in modules - {"Module"}:
        for node in ast.walk(classes[name]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names |= {node.attr} if ast.unparse(node.value) == "self" else set()
        names |= {
            t.id for s in classes[name].body if isinstance(s, ast.Assign) for t in s.targets
        } - {""}
    return {n for n in names if not n.startswith("__")}


def _attribute_sets(source: str, attributes: set[str]) -> list[str]:
    """``obj.attr = ...`` (or ``+=``, annotated) and ``setattr(obj, "attr", ...)`` in
    ``source`` where ``attr`` is one of ``attributes`` and ``obj`` is not the code's own
    (``self``, ``cls``, an autograd function's ``ctx``), by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
            owner, name = node.args[:2]
            named = isinstance(name, ast.Constant) and name.value in attributes
            if named and ast.unparse(owner) not in OWN:
                found.append((node.lineno, ast.unparse(node)))
        for t in targets:
            stored = isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
            if stored and t.attr in attributes and ast.unparse(t.value) not in OWN:
                found.append((t.lineno, f"{ast.unparse(t)} = ..."))
    return [f"{line}: {text}" for line, text in sorted(found)]


def test_the_source_scan_finds_each_way_of_patching_a_module():
    """The scan itself: what execution/ did before attention took its kernel when built."""
    attributes = _module_attributes()
    assert {"core", "kernel", "qkv", "forward", "position", "repeat_kv"} <= attributes
    patched = (
        "m.kernel = chosen\n"
        "block.attn.core = recomputed\n"
        "setattr(m, 'position', rotary)\n"
        "block.attn.qkv: object = None\n"
        "self.kernel = mine\n"  # a class of execution/ setting its own attribute
        "plan.kernels = ()\n"  # no module has it
    )
    assert [line.split(":")[0] for line in _attribute_sets(patched, attributes)] == list("1234")


def test_no_code_outside_modelling_sets_an_attribute_of_a_model_s_module():
    attributes = _module_attributes()
    found = {
        path: hits
        for path in library_files()
        if not path.startswith("modelling/")
        and path != BASELINES
        and (hits := _attribute_sets((ROOT / path).read_text(), attributes))
    }
    assert found == {}


@pytest.mark.slow
def test_building_stepping_and_planning_set_no_attribute_of_a_model_s_module(monkeypatch):
    """At run time: an engine with every attention slot there was (selective recompute,
    --compile with dropout as one op), its step, and planning's layer on meta tensors with a
    GPU's kernel; every attribute set on a modelling module comes from modelling/ itself (or
    torch's own code)."""
    outside: list[str] = []
    original = nn.Module.__setattr__

    def recording(module, name, value):
        caller = Path(sys._getframe(1).f_code.co_filename).resolve()
        ours = any(c.__module__.startswith("modelling.") for c in type(module).__mro__)
        if ours and ROOT in caller.parents and MODELLING not in caller.parents:
            outside.append(f"{type(module).__name__}.{name} from {caller.relative_to(ROOT)}")
        original(module, name, value)

    monkeypatch.setattr(nn.Module, "__setattr__", recording)
    flags = ("--dropout_prob", "0.1", "--recompute", "selective", "--placement", "resident")
    layout = ParallelLayout.single(CPU)
    planned_engine(small_config(*flags, "--compile", "true"), layout)  # built, not stepped
    config = small_config(*flags)
    engine = planned_engine(config, layout)
    engine.train_step(replica_batch(config, global_batches(config, 1)[0], 0), 0, 1e-4)
    shapes = GPTShapes(2, 32, 4, 64, 16, 0.1, 1e-5)
    kept_layer_on_meta(shapes, 1, 16, torch.bfloat16, "selective", "flash")
    assert outside == []
