"""The built-in models' step names, kept for old imports: one implementation, in
``paged_jax.step`` (any model with ``paged_forward``, not only ``Decoder``).

- ``prefill_step(model, alloc_state, cache, tokens_T, num_new_S, *, impl=None)``:
  ``paged_jax.step.forward_step`` (``impl`` passed on to ``paged_forward`` when given).
- ``decode_step(model, alloc_state, cache, tokens_S, active_S, *, impl=None)``:
  ``paged_jax.step.decode_step``.
- ``Steps(model, *, impl=None)``: ``paged_jax.step.Steps`` (``prefill`` is ``forward``).
"""

from __future__ import annotations

from paged_jax import step as _step

__all__ = ["Steps", "decode_step", "prefill_step"]


def _kwargs(impl):
  return {} if impl is None else dict(impl=impl)


def prefill_step(model, alloc_state, cache, tokens_T, num_new_S, *, impl: str | None = None):
  """``paged_jax.step.forward_step``; ``impl`` overrides the model's attention impl."""
  return _step.forward_step(model, alloc_state, cache, tokens_T, num_new_S, **_kwargs(impl))


def decode_step(model, alloc_state, cache, tokens_S, active_S, *, impl: str | None = None):
  """``paged_jax.step.decode_step``; ``impl`` overrides the model's attention impl."""
  return _step.decode_step(model, alloc_state, cache, tokens_S, active_S, **_kwargs(impl))


class Steps(_step.Steps):
  """``paged_jax.step.Steps``, with the built-in decoders' ``impl`` keyword."""

  def __init__(self, model, *, impl: str | None = None):
    super().__init__(model, **_kwargs(impl))
