"""What the engine hands back: ``Output`` (one completion, from ``generate``) and
``StreamEvent`` (one token or end, from ``generate_stream`` and ``Session.step``)."""

from __future__ import annotations

import dataclasses

__all__ = ["Output", "StreamEvent"]


@dataclasses.dataclass(frozen=True)
class Output:
  """One completion.

  Attributes:
    prompt_index: index of the prompt in the ``generate`` call.
    sample_index: completion index within the prompt (0 .. n-1).
    prompt_token_ids: the prompt's token ids (a list).
    token_ids: generated ids, a list (the stop / EOS token not included).
    text: ``token_ids`` decoded when the engine has a tokenizer (up to a stop string:
      ``SamplingParams.stop``; special tokens left out unless
      ``SamplingParams.skip_special_tokens`` is False), else None.
    finish_reason: "stop" (EOS, a stop id or a stop string) or "length" (max_tokens or
      max_model_len).
    logprobs: log-probability of each generated id, a list (``SamplingParams.logprobs``),
      else None.
    stop_reason: what ended a "stop": the stop string (str) or the id of
      ``SamplingParams.stop_token_ids`` (int) it reached; None at an EOS id of the engine
      (unless ``ignore_eos``; listed in ``stop_token_ids`` too) and for "length", as vLLM's
      (which also names a checkpoint's extra EOS ids from its generation config).
    top_logprobs: with ``SamplingParams.top_logprobs`` = k > 0, a list with one dict per
      generated id: the k likeliest ids at its position and their log-probabilities
      (``{id: logprob}``, most likely first); else None.
    prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, a list with one entry per
      prompt token: None for the first, then the log-probability of each token given the
      ones before it; else None. Alike in every completion of the prompt.
    prompt_top_logprobs: with ``SamplingParams.prompt_logprobs`` = k > 0, a list with one
      entry per prompt token: None for the first, then the k likeliest ids at its position
      (``{id: logprob}``, most likely first); else None.
  Lists (``out.token_ids == [5, 9]`` as a user means it); an Output still hashes.
  """

  prompt_index: int
  sample_index: int
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str | None
  finish_reason: str
  logprobs: list[float] | None = None
  stop_reason: int | str | None = None
  top_logprobs: list[dict[int, float]] | None = None
  prompt_logprobs: list[float | None] | None = None
  prompt_top_logprobs: list[dict[int, float] | None] | None = None

  def __hash__(self):  # lists as tuples, dicts as sets of items: equal outputs hash alike
    frozen = lambda v: (tuple(frozen(x) for x in v) if isinstance(v, list)
                        else frozenset(v.items()) if isinstance(v, dict) else v)
    return hash(tuple(frozen(v) for v in vars(self).values()))


@dataclasses.dataclass(frozen=True)
class StreamEvent:
  """One event of ``generate_stream`` or ``Session.step``: a token (``token_id`` set) or the
  end of a completion (``token_id`` None, ``finish_reason`` and ``stop_reason`` set as
  ``Output``'s; ``finish_reason`` "abort" for a request a session aborted). ``text``:
  with a tokenizer, the text the event adds to the completion's (maybe ""; text that could
  begin a stop string, or a character whose bytes are not all in yet, comes with a later
  event), so the ``text`` of a completion's events joined is its ``Output.text``; None
  without a tokenizer. ``top_logprobs``: a token's ``{id: logprob}`` of the likeliest ids
  when its request asks for them (``SamplingParams.top_logprobs``), else None.
  ``prompt_logprobs`` / ``prompt_top_logprobs``: ``Output``'s, on a completion's first
  event (token or end) when its request asks for them (``SamplingParams.prompt_logprobs``),
  else None; an "abort" before the prompt was all computed has None where it was not."""

  prompt_index: int
  sample_index: int
  token_id: int | None
  logprob: float | None = None
  finish_reason: str | None = None
  text: str | None = None
  stop_reason: int | str | None = None
  top_logprobs: dict[int, float] | None = None
  prompt_logprobs: list[float | None] | None = None
  prompt_top_logprobs: list[dict[int, float] | None] | None = None
