"""``metadata.search_right``: ``jnp.searchsorted(side="right")``'s result, with no loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.pallas_kernels import metadata


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 300])
def test_search_right_matches_searchsorted_without_a_loop(n):
  rng = np.random.default_rng(n)
  sorted_a = np.sort(rng.integers(0, 50, n)).astype(np.int32)  # repeats included
  v = np.arange(-2, 53, dtype=np.int32)
  got = jax.jit(metadata.search_right)(sorted_a, v)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.searchsorted(sorted_a, v, side="right"))
  text = jax.jit(metadata.search_right).lower(sorted_a, v).as_text()
  assert "stablehlo.while" not in text
