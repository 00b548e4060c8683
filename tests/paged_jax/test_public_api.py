"""The package's public names: everything in ``paged_jax.__all__`` is an attribute after
``import paged_jax`` (the lazy ``__getattr__`` imports it on first use), the user-facing
submodules included."""

from __future__ import annotations

import importlib

import pytest

import paged_jax

SUBMODULES = ("allocator", "attention", "engine", "kv_cache", "kv_groups", "models",
              "pallas_kernels", "planner", "protocol", "sampling", "sharding", "spec", "step",
              "testing")


@pytest.mark.parametrize("name", SUBMODULES)
def test_submodules_are_attributes_of_the_package(name, monkeypatch):
  # Importing the submodule elsewhere binds it on the package as a side effect; drop that
  # binding so the package's own __getattr__ must find it.
  monkeypatch.delattr(paged_jax, name, raising=False)
  module = getattr(paged_jax, name)
  assert module is importlib.import_module(f"paged_jax.{name}")
  assert name in paged_jax.__all__ and name in dir(paged_jax)


def test_every_public_name_resolves(monkeypatch):
  for name in paged_jax.__all__:
    monkeypatch.delattr(paged_jax, name, raising=False)
    assert getattr(paged_jax, name) is not None, name
  assert sorted(paged_jax.__all__) == paged_jax.__all__ and len(set(paged_jax.__all__)) == len(
      paged_jax.__all__)


def test_every_lazily_imported_name_is_public():
  # checked_paged_attention resolved lazily but was missing from __all__ (and so from
  # dir() and `from paged_jax import *`).
  lazy = set(paged_jax._MODULE_OF) | set(paged_jax._SUBMODULES)
  assert lazy <= set(paged_jax.__all__), sorted(lazy - set(paged_jax.__all__))
  assert lazy <= set(dir(paged_jax))


def test_dir_lists_public_names_and_dunders_only():
  # dir() showed the module's own helpers (importlib, TYPE_CHECKING, annotations, _HOME).
  listed = set(dir(paged_jax))
  assert set(paged_jax.__all__) <= listed and "__version__" in listed
  assert listed - set(paged_jax.__all__) == {n for n in listed if n.startswith("__")}


def test_unknown_names_still_raise_attribute_error():
  with pytest.raises(AttributeError, match="no_such_name"):
    paged_jax.no_such_name  # noqa: B018
