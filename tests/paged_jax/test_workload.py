"""The synthetic workload: deterministic, bounded, long-tailed."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.workload import Workload, make_requests


def test_deterministic_bounded_and_long_tailed():
  w = Workload(num_requests=400, seed=3)
  prompts, params = make_requests(w)
  again, params2 = make_requests(w)
  assert prompts == again and params == params2
  assert make_requests(Workload(num_requests=400, seed=4))[0] != prompts
  p_len = np.array([len(p) for p in prompts])
  o_len = np.array([sp.max_tokens for sp in params])
  assert p_len.min() >= 1 and p_len.max() <= w.max_prompt_len
  assert o_len.min() >= 1 and o_len.max() <= w.max_output_len
  assert all(w.first_token_id <= t < w.vocab_size for p in prompts for t in p)
  assert all(sp.ignore_eos and sp.temperature == 0 for sp in params)
  # log-normal: median near the parameter, a tail well above it.
  assert abs(np.median(p_len) - w.prompt_median) <= 4
  assert abs(np.median(o_len) - w.output_median) <= 3
  assert np.percentile(p_len, 95) > 2.5 * w.prompt_median


@pytest.mark.parametrize("kwargs, field", [(dict(num_requests=0), "num_requests"),
                                           (dict(prompt_sigma=-1.0), "prompt_sigma"),
                                           (dict(first_token_id=300), "first_token_id")])
def test_validation(kwargs, field):
  with pytest.raises(ValueError, match=field):
    Workload(**kwargs)
