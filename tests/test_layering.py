"""Layering a reader can see: the module import graph of the library has no cycle.

The graph is built from the source (``ast``) of every module of ``paged_jax/``,
``models/`` (``paged_jax.models``) and ``pallas_kernels/`` (``paged_jax.pallas_kernels``),
lazy imports inside functions included. An edge goes from a module to each library module
it names: ``from a.b import c`` names ``a.b.c`` when that is a module, else ``a.b``;
``import a.b`` names ``a.b``. (Importing ``a.b`` also runs package ``a``'s ``__init__``;
that implicit edge is not counted, so a package ``__init__`` may re-export its modules.)
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"paged_jax": "paged_jax", "models": "paged_jax.models",
            "pallas_kernels": "paged_jax.pallas_kernels"}


def _modules() -> dict[str, str]:
  """Module name -> file, for every library module."""
  out = {}
  for folder, prefix in PACKAGES.items():
    base = os.path.join(ROOT, folder)
    for dirpath, dirnames, filenames in os.walk(base):  # links (paged_jax/models) not followed
      dirnames[:] = [d for d in dirnames if d != "__pycache__"
                     and not os.path.islink(os.path.join(dirpath, d))]
      rel = os.path.relpath(dirpath, base)
      parts = [prefix] + ([] if rel == "." else rel.split(os.sep))
      for name in filenames:
        if name.endswith(".py"):
          mod = parts if name == "__init__.py" else parts + [name[:-3]]
          out[".".join(mod)] = os.path.join(dirpath, name)
  return out


def _edges(modules: dict[str, str]) -> dict[str, set[str]]:
  graph = {m: set() for m in modules}
  for mod, path in modules.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(anchor + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
      else:
        continue
      for target in targets:
        top = target.split(".")[0]
        assert top not in ("models", "pallas_kernels"), (
            f"{mod} imports {target!r}: a user's own folder of that name would shadow it; "
            "import paged_jax.models / paged_jax.pallas_kernels")
        if target in modules and target != mod:
          graph[mod].add(target)
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


@pytest.fixture(scope="module")
def graph():
  return _edges(_modules())


def test_the_import_graph_has_no_cycle(graph):
  assert _cycles(graph) == []


def test_the_graph_sees_the_imports_it_must(graph):
  # Evidence that the graph is the real one: known edges, lazy ones included.
  assert "paged_jax.step" in graph["paged_jax.models.decoder"]
  assert "paged_jax.step" in graph["paged_jax.engine.device"]
  assert "paged_jax.models.loader" in graph["paged_jax.engine.llm"]  # inside from_pretrained
  assert "paged_jax.engine" in graph["paged_jax"]
  assert "paged_jax.pallas_kernels.layout" in graph["paged_jax.kv_cache"]
  # Nothing but the facade's re-exports imports the facade itself.
  assert [m for m, targets in graph.items() if "paged_jax" in targets] == []
  # The kernels import nothing from paged_jax outside pallas_kernels.
  for mod, targets in graph.items():
    if mod.startswith("paged_jax.pallas_kernels"):
      assert all(t.startswith("paged_jax.pallas_kernels") for t in targets), (mod, targets)


def test_the_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_engine_modules_stay_small():
  folder = os.path.join(ROOT, "paged_jax", "engine")
  for name in os.listdir(folder):
    if name.endswith(".py"):
      with open(os.path.join(folder, name), encoding="utf-8") as f:
        assert len(f.readlines()) < 400, name
