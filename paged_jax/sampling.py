"""Sampling parameters and the jit-able per-row sampler of the engine.

``SamplingParams`` is the host-side, frozen description of how one request is decoded.
``sample`` draws one token for every row of a ``[S, V]`` logits batch, each row with its own
temperature, top-k, top-p and PRNG key; ``request_keys`` derives those keys so that a
request's draws depend only on ``(seed, fork index, request-local token index)``, never on
the step number or the batch slot (reproducible whatever else is in the batch).

``adjust`` applies what a request asks of the logits first: its allowed tokens and its logit
bias, then what its history changes (repetition, presence and frequency penalties), then
its stop ids barred until ``min_tokens``.

Semantics (per row):
- the logits are adjusted (``adjust``; nothing changes at the neutral values).
- ``temperature == 0``: greedy (argmax of the adjusted logits); top-k / top-p / min-p are
  ignored.
- otherwise the logits are divided by the temperature, then top-k keeps the k largest
  (``top_k == 0``: all; tokens tied with the k-th largest are kept too), then top-p keeps
  the smallest set of the largest remaining tokens whose probability (renormalised after
  top-k) reaches ``top_p`` (tokens tied with the last kept value are kept too), then min-p
  keeps those at least ``min_p`` times as likely as the most likely one, and a token is
  drawn from what is left (transformers' order).
- logprobs: ``log_softmax`` of the UNMODIFIED logits (the model's own distribution, no
  penalty, temperature, top-k, top-p or min-p), evaluated at the chosen token.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings
from collections import abc
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax._json import read_json_object

__all__ = ["Adjustments", "MAX_ALLOWED_TOKEN_IDS", "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS",
           "SamplingParams", "adjust", "min_p_filter", "sample", "request_keys", "top_logprobs",
           "truncate"]

_UINT32_MAX = 2 ** 32 - 1
MAX_TOP_LOGPROBS = 20
"""The most ``SamplingParams.top_logprobs`` (OpenAI's limit; the engine's fixed width)."""
MAX_LOGIT_BIAS = 300
"""The most tokens one ``SamplingParams.logit_bias`` biases (the engine's fixed width)."""
MAX_ALLOWED_TOKEN_IDS = MAX_LOGIT_BIAS
"""The most ids one ``SamplingParams.allowed_token_ids`` allows (they share the bias's row)."""
LOGIT_BIAS_LIMIT = 100.0
"""A bias lies in ``[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]`` (OpenAI's range)."""
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_real(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite(x) -> bool:
  """A real number (a Fraction too, which NumPy's isfinite does not take) is finite."""
  try:
    return math.isfinite(float(x))
  except OverflowError:  # a Fraction past float's range
    return False


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is decoded.

  Attributes:
    max_tokens: most tokens to generate (>= 1); the request finishes with "length" there
      (or at the engine's ``max_model_len``).
    temperature: 0 is greedy; > 0 samples from ``softmax(logits / temperature)``.
    top_k: keep the k most likely tokens, and any tied with the k-th (0: no limit).
    top_p: nucleus sampling threshold in (0, 1] (1: no limit).
    seed: None (the engine draws one) or an int in [0, 2**32): the request's PRNG stream,
      reproducible regardless of batch composition.
    stop_token_ids: extra ids that finish the request with "stop" (not included in the
      output), like the checkpoint's EOS ids. The engine keeps at most 16 distinct stop
      ids a request, its EOS ids included (``engine.state.MAX_STOP_IDS``: a fixed-size row
      on the device); more is a ``ValueError`` naming the request.
    ignore_eos: do not stop at the EOS ids (stop_token_ids still stop).
    logprobs: report the log-probability of each generated token (``Output.logprobs``)
      under the model's own distribution: ``log_softmax`` of the logits before temperature,
      top-k and top-p (as vLLM's default), so greedy and sampled runs report alike.
    n: completions per prompt (>= 1); n > 1 forks the prompt's KV blocks after its prefill
      and each completion gets its own sampling stream (the fork index is folded in).
    stop: strings (one str, a sequence of them, or None for none; each non-empty) that
      finish the request with "stop" when its generated text reaches one (needs the
      engine's tokenizer).
      ``Output.text`` ends before it; ``Output.token_ids`` ends with the token that
      completed it (tokens the device generated after it in the same call are dropped).
    include_stop_str_in_output: end ``Output.text`` after the stop string instead.
    min_p: with temperature > 0, drop the tokens less likely than ``min_p`` times the most
      likely one (after temperature; kept only if top-k and top-p keep them too), in
      [0, 1] (0: no limit).
    repetition_penalty: > 0 (1: none); the logit of every token already in the sequence
      (prompt or generated) is divided by it where positive and multiplied by it where
      not, as transformers' ``repetition_penalty`` does; greedy decoding too. A finite
      logit stays finite (clipped to float32's range).
    presence_penalty: in [-2, 2] (0: none); subtracted from the logit of every token
      generated so far (OpenAI's definition; the prompt does not count).
    frequency_penalty: in [-2, 2] (0: none); subtracted from the logit of each token once
      per time it was generated so far (the prompt does not count).
    min_tokens: tokens to generate before a stop id or a stop string may end the request,
      in [0, max_tokens]: until then the request's stop ids (``stop_token_ids`` and, unless
      ``ignore_eos``, the EOS ids) are never drawn, and a stop string counts only where a
      token after the first ``min_tokens`` completes it (vLLM's rule: no earlier than a stop
      id could end the request).
    top_logprobs: with ``logprobs``, also report the ``top_logprobs`` most likely tokens at
      each generated position with their log-probabilities (``Output.top_logprobs``: a
      ``{token_id: logprob}`` dict per generated token, most likely first, ties by smaller
      id), under the same distribution as ``logprobs`` (the model's own: the chosen token
      is among them only when that distribution ranks it there; penalties or a bar of
      ``min_tokens`` may choose another, greedy too; listed, its value is its ``logprobs``
      entry exactly); an int in [0, ``MAX_TOP_LOGPROBS`` = 20] (0: none), OpenAI's
      ``top_logprobs``.
    logit_bias: ``{token_id: bias}`` (a mapping, or ``(id, bias)`` pairs; None or empty:
      none), OpenAI's ``logit_bias``: each bias, a number in [-100, 100], is added to its
      token's logit before anything else changes the logits (penalties, the bar of
      ``min_tokens``, temperature, top-k, top-p, min-p; vLLM's order), greedy decoding too;
      -100 all but bans a token, +100 all but forces it. At most ``MAX_LOGIT_BIAS`` = 300
      tokens; ids must lie in the engine's vocabulary. ``logprobs`` and ``top_logprobs``
      stay the model's own distribution, unbiased. Held as ``(id, bias)`` pairs in
      increasing id (a frozen, hashable field); ``dict(params.logit_bias)`` is the mapping.
    allowed_token_ids: None (every token) or the only token ids the request may generate
      (vLLM's ``allowed_token_ids``; e.g. a classifier's labels): every other token's logit
      is -inf before anything else changes the logits (a ``logit_bias`` of an id outside
      them does nothing), greedy decoding too. A non-empty sequence of ids, at most
      ``MAX_ALLOWED_TOKEN_IDS`` = 300 distinct ones, in the engine's vocabulary; held as a
      sorted tuple without repeats. The stop ids are not added: allow the EOS id to let the
      request stop early, and not only stop ids where ``min_tokens`` bars them (the engine
      refuses that). ``logprobs`` and ``top_logprobs`` stay the model's own distribution.
    skip_special_tokens: leave the tokenizer's special tokens out of ``Output.text`` (and
      the streamed text; vLLM's default); False keeps them, as a chat format that marks
      its parts with special tokens needs (gpt-oss's harmony ``<|channel|>``, ...). Stop
      strings are looked for in that text. ``token_ids`` hold every id either way.
    truncate_prompt_tokens: None (the whole prompt) or k >= 1: only the prompt's last k
      tokens are served (left truncation, vLLM's; ``Output.prompt_token_ids`` holds
      them); of a text prompt, the special tokens the tokenizer adds around every text (a
      BOS) stay, counted among the k, as a tokenizer's own truncation keeps them; token
      ids (``LLM.chat``'s laid-out conversations too) are cut as given; -1:
      ``max_model_len - 1`` tokens, the most that leave room for one to generate.
    prompt_logprobs: None (none) or k in [0, ``MAX_TOP_LOGPROBS`` = 20]: report the
      log-probability of each prompt token given the tokens before it
      (``Output.prompt_logprobs``: one entry per prompt token, None for the first, which
      nothing predicts; vLLM's ``prompt_logprobs``, for scoring and perplexity), the model's
      own distribution, and with k > 0 the k likeliest tokens at each prompt position
      (``Output.prompt_top_logprobs``: a ``{token_id: logprob}`` dict per prompt token, None
      for the first). The prompt is computed whole (no prefix-cache hits: a cached token's
      logits were never computed) in steps that score every token, which cost a vocabulary
      projection per token, not per sequence.
  """

  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  logprobs: bool = False
  n: int = 1
  stop: tuple[str, ...] = ()
  include_stop_str_in_output: bool = False
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  min_tokens: int = 0
  top_logprobs: int = 0
  logit_bias: tuple[tuple[int, float], ...] = ()
  allowed_token_ids: tuple[int, ...] | None = None
  skip_special_tokens: bool = True
  truncate_prompt_tokens: int | None = None
  prompt_logprobs: int | None = None

  def __post_init__(self):
    max_tokens, temperature, top_k, top_p = (self.max_tokens, self.temperature, self.top_k,
                                             self.top_p)
    seed, n = self.seed, self.n
    if not _is_int(max_tokens) or max_tokens < 1:
      raise ValueError(f"{max_tokens=} must be an int >= 1")
    if (not _is_real(temperature) or not _finite(temperature) or temperature < 0
        or temperature > _FLOAT32_MAX):
      raise ValueError(f"{temperature=} must be a finite number >= 0 (at most float32's "
                       f"largest, {_FLOAT32_MAX:.4g}: the sampler divides in float32)")
    if not _is_int(top_k) or not 0 <= top_k < 2**31:
      raise ValueError(f"{top_k=} must be an int in [0, 2**31) (0 disables top-k)")
    if not _is_real(top_p) or not 0 < top_p <= 1:
      raise ValueError(f"{top_p=} must be a number in (0, 1]")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= _UINT32_MAX):
      raise ValueError(f"{seed=} must be None or an int in [0, 2**32)")
    try:
      stop = tuple(self.stop_token_ids)
    except TypeError:
      raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a sequence of ints "
                       ">= 0") from None
    if not all(_is_int(t) and t >= 0 for t in stop):
      raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a sequence of ints "
                       ">= 0")
    if not isinstance(self.ignore_eos, (bool, np.bool_)):
      raise ValueError(f"ignore_eos={self.ignore_eos!r} must be a bool")
    if not isinstance(self.logprobs, (bool, np.bool_)):
      raise ValueError(f"logprobs={self.logprobs!r} must be a bool")
    if not _is_int(n) or n < 1:
      raise ValueError(f"{n=} must be an int >= 1")
    stop_strings = () if self.stop is None else self.stop
    if isinstance(stop_strings, str):
      stop_strings = (stop_strings,)  # "" is refused below: it would stop at once
    if (isinstance(stop_strings, (bytes, abc.Mapping, abc.Set))
        or not isinstance(stop_strings, abc.Iterable)):
      stop_strings = None
    else:
      stop_strings = tuple(stop_strings)
    if stop_strings is None or not all(isinstance(t, str) and t for t in stop_strings):
      raise ValueError(f"stop={self.stop!r} must be a non-empty str, a sequence of them, or "
                       "None")
    keep = self.truncate_prompt_tokens
    if keep is not None and (not _is_int(keep) or not (keep >= 1 or keep == -1)):
      raise ValueError(f"truncate_prompt_tokens={keep!r} must be None, an int >= 1 (the "
                       "prompt's last that many tokens) or -1 (the most the engine takes)")
    if not isinstance(self.skip_special_tokens, (bool, np.bool_)):
      raise ValueError(f"skip_special_tokens={self.skip_special_tokens!r} must be a bool")
    if not isinstance(self.include_stop_str_in_output, (bool, np.bool_)):
      raise ValueError(f"include_stop_str_in_output={self.include_stop_str_in_output!r} must "
                       "be a bool")
    if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
      raise ValueError(f"min_p={self.min_p!r} must be a number in [0, 1] (0: no limit)")
    if (not _is_real(self.repetition_penalty) or not _finite(self.repetition_penalty)
        or not _FLOAT32_TINY <= self.repetition_penalty <= _FLOAT32_MAX):
      raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be a finite "
                       f"number > 0 (1: none; at least {_FLOAT32_TINY:.4g}: the sampler "
                       "divides in float32)")
    for name in ("presence_penalty", "frequency_penalty"):
      value = getattr(self, name)
      if not _is_real(value) or not -2 <= value <= 2:
        raise ValueError(f"{name}={value!r} must be a number in [-2, 2] (0: none)")
    if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= max_tokens:
      raise ValueError(f"min_tokens={self.min_tokens!r} must be an int in [0, max_tokens="
                       f"{max_tokens}]")
    if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
      raise ValueError(f"top_logprobs={self.top_logprobs!r} must be an int in [0, "
                       f"{MAX_TOP_LOGPROBS}] (0: none)")
    if self.top_logprobs and not self.logprobs:
      raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True (as OpenAI's "
                       "API asks)")
    object.__setattr__(self, "top_logprobs", int(self.top_logprobs))
    prompt_k = self.prompt_logprobs
    if prompt_k is not None and (not _is_int(prompt_k)
                                 or not 0 <= prompt_k <= MAX_TOP_LOGPROBS):
      raise ValueError(f"prompt_logprobs={prompt_k!r} must be None or an int in [0, "
                       f"{MAX_TOP_LOGPROBS}] (0: each prompt token's own log-prob only)")
    object.__setattr__(self, "prompt_logprobs", None if prompt_k is None else int(prompt_k))
    object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
    object.__setattr__(self, "allowed_token_ids", _allowed_token_ids(self.allowed_token_ids))
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
      object.__setattr__(self, name, float(getattr(self, name)))
    object.__setattr__(self, "min_tokens", int(self.min_tokens))
    object.__setattr__(self, "max_tokens", int(max_tokens))
    object.__setattr__(self, "temperature", float(temperature))
    object.__setattr__(self, "top_k", int(top_k))
    object.__setattr__(self, "top_p", float(top_p))
    object.__setattr__(self, "seed", None if seed is None else int(seed))
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
    object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
    object.__setattr__(self, "logprobs", bool(self.logprobs))
    object.__setattr__(self, "n", int(n))
    object.__setattr__(self, "stop", tuple(dict.fromkeys(str(t) for t in stop_strings)))
    object.__setattr__(self, "include_stop_str_in_output",
                       bool(self.include_stop_str_in_output))
    object.__setattr__(self, "skip_special_tokens", bool(self.skip_special_tokens))
    object.__setattr__(self, "truncate_prompt_tokens", None if keep is None else int(keep))

  @classmethod
  def from_generation_config(cls, source: str | os.PathLike | Mapping[str, Any],
                             **overrides) -> "SamplingParams":
    """The sampling a checkpoint's ``generation_config.json`` asks for, as transformers'
    ``generate`` resolves it, with ``overrides`` (any field) taking precedence.

    ``source``: a checkpoint directory (its ``generation_config.json``; none there: the
    defaults below), the file itself, or its contents as a mapping (e.g. a transformers
    ``GenerationConfig.to_dict()``). Without ``do_sample: true`` decoding is greedy (top-k
    and top-p do nothing then); with it, ``temperature`` (default 1.0; 0 is greedy here),
    ``top_k`` (default 50, transformers' own, also for null; 0 keeps every token) and ``top_p``
    (default 1.0) and ``min_p`` (default 0). ``repetition_penalty`` applies greedy or not.
    ``max_new_tokens`` becomes ``max_tokens``, ``min_new_tokens`` ``min_tokens`` (at most
    ``max_tokens``, with a warning: transformers stops there first; it holds stop strings
    back too, as vLLM's does, where transformers bars only EOS), ``num_return_sequences``
    ``n`` and ``stop_strings`` ``stop``. ``max_length`` and ``min_length`` count the prompt too, so
    they are not per-request counts: the engine's ``max_model_len`` bounds the whole
    sequence. EOS ids are the engine's already (``LLM.from_pretrained`` reads them from this
    file). Settings this sampler does not have (``num_beams``, ``no_repeat_ngram_size``,
    ``typical_p`` when sampling, ...) at other than their neutral values are named in a
    warning, not applied.
    """
    cfg, where = _generation_config(source)
    get = lambda key, default: default if cfg.get(key) is None else cfg[key]
    do_sample = get("do_sample", False)
    if not isinstance(do_sample, bool):
      raise ValueError(f"{where}: do_sample={do_sample!r} must be true or false")
    fields = {}
    if do_sample:
      fields.update(temperature=get("temperature", 1.0), top_k=get("top_k", 50),
                    top_p=get("top_p", 1.0), min_p=get("min_p", 0.0))
    for key, field in (("repetition_penalty", "repetition_penalty"), *_RENAMED):
      if cfg.get(key) is not None:
        fields[field] = cfg[key]
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"overrides {unknown} are not SamplingParams fields (fields: "
                       f"{', '.join(f.name for f in dataclasses.fields(cls))})")
    if "min_tokens" in fields and "min_tokens" not in overrides:
      max_tokens = overrides.get("max_tokens", fields.get("max_tokens", cls.max_tokens))
      cut = _cut_min_tokens(fields["min_tokens"], max_tokens)
      if cut != fields["min_tokens"]:
        warnings.warn(f"{where}: min_new_tokens={fields['min_tokens']} is above max_tokens="
                      f"{max_tokens}, where the request ends (min_tokens={max_tokens})",
                      stacklevel=2)
        fields["min_tokens"] = cut
    unapplied = {**_NOT_APPLIED, **(_NOT_APPLIED_WHEN_SAMPLING if do_sample else {})}
    ignored = [f"{key}={cfg[key]!r}" for key, neutral in unapplied.items()
               if cfg.get(key) not in (None, [], {}) and cfg[key] not in neutral]
    if ignored:
      warnings.warn(f"{where} asks for {', '.join(ignored)}, which paged_jax's sampler does "
                    "not do; generating without", stacklevel=2)
    try:
      return cls(**{**fields, **overrides})
    except ValueError:
      own = {k: v for k, v in fields.items() if k not in overrides}
      if "max_tokens" not in own and "min_tokens" in own:  # cut as above, at the default
        own["min_tokens"] = _cut_min_tokens(own["min_tokens"], cls.max_tokens)
      try:  # a value of the file's (not overridden) is named with the file, by its key
        cls(**own)
      except ValueError as e:
        message = str(e)
        for key, field in _RENAMED:
          if key in cfg and message.startswith(f"{field}="):
            message = key + message[len(field):]
        raise ValueError(f"{where}: {message}") from None
      raise


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
  """``SamplingParams.logit_bias`` checked, as ``(id, bias)`` pairs in increasing id."""
  expected = (f"must be a mapping of token ids (ints >= 0) to numbers in [-{LOGIT_BIAS_LIMIT:g}"
              f", {LOGIT_BIAS_LIMIT:g}] (or such (id, bias) pairs), at most {MAX_LOGIT_BIAS} "
              "of them")
  if value is None:
    return ()
  try:
    if isinstance(value, abc.Mapping):
      pairs = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, abc.Iterable):
      raise TypeError
    else:
      pairs = list(value)
  except TypeError:
    raise ValueError(f"logit_bias={value!r} {expected}") from None
  if len(pairs) > MAX_LOGIT_BIAS:
    raise ValueError(f"logit_bias biases {len(pairs)} tokens, {expected}")
  for pair in pairs:
    # A pair is a tuple or a list: a dict or set of two would be read in its own order.
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise ValueError(f"logit_bias={value!r} {expected}: {pair!r} is no (id, bias) pair")
    token, bias = pair
    if not _is_int(token) or token < 0:
      hint = " (JSON's keys are strings: make them ints)" if isinstance(token, str) else ""
      raise ValueError(f"logit_bias key {token!r} must be a token id, an int >= 0{hint}")
    if not _is_real(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
      raise ValueError(f"logit_bias[{token}]={bias!r} must be a number in "
                       f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
  if len({int(t) for t, _ in pairs}) != len(pairs):
    raise ValueError(f"logit_bias={value!r} names a token id twice")
  return tuple(sorted((int(t), float(b)) for t, b in pairs))


def _allowed_token_ids(value) -> tuple[int, ...] | None:
  """``SamplingParams.allowed_token_ids`` checked: None, or its distinct ids in order."""
  if value is None:
    return None
  expected = (f"must be None or a non-empty sequence of token ids (ints >= 0), at most "
              f"{MAX_ALLOWED_TOKEN_IDS} distinct ones")
  if (isinstance(value, (str, bytes, abc.Mapping)) or not isinstance(value, abc.Iterable)
      or isinstance(value, np.ndarray) and value.ndim != 1):
    raise ValueError(f"allowed_token_ids={value!r} {expected}")
  ids = list(value)
  bad = [t for t in ids if not _is_int(t) or t < 0]
  if bad:
    raise ValueError(f"allowed_token_ids holds {bad[0]!r}: it {expected}")
  distinct = sorted({int(t) for t in ids})
  if not distinct:
    raise ValueError(f"allowed_token_ids={value!r} is empty: it {expected} (None allows "
                     "every token)")
  if len(distinct) > MAX_ALLOWED_TOKEN_IDS:
    raise ValueError(f"allowed_token_ids holds {len(distinct)} distinct ids: it {expected}")
  return tuple(distinct)


def _cut_min_tokens(min_tokens, max_tokens):
  """A file's ``min_new_tokens`` cut to a valid ``max_tokens`` (where the request ends, as
  in transformers); anything else as it is (``SamplingParams`` refuses what is invalid)."""
  if _is_int(min_tokens) and _is_int(max_tokens) and min_tokens > max_tokens >= 1:
    return max_tokens
  return min_tokens


# generation_config.json keys whose ``SamplingParams`` field has another name.
_RENAMED = (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"),
            ("num_return_sequences", "n"), ("stop_strings", "stop"))

# generation_config.json settings ``SamplingParams`` has no counterpart for, each with the
# values that change nothing (anything else is named in ``from_generation_config``'s
# warning); the sampling-only ones change nothing under greedy decoding either.
_NOT_APPLIED = {"encoder_repetition_penalty": (1, 1.0), "num_beams": (1,),
                "no_repeat_ngram_size": (0,), "min_length": (0,), "bad_words_ids": (),
                "suppress_tokens": (),
                "begin_suppress_tokens": (), "penalty_alpha": (0, 0.0),
                "sequence_bias": (), "forced_bos_token_id": (), "forced_eos_token_id": (),
                "exponential_decay_length_penalty": (), "guidance_scale": (1, 1.0),
                "dola_layers": ()}
_NOT_APPLIED_WHEN_SAMPLING = {"typical_p": (1, 1.0),
                              "epsilon_cutoff": (0, 0.0), "eta_cutoff": (0, 0.0),
                              "top_h": ()}


def _generation_config(source) -> tuple[Mapping[str, Any], str]:
  """The settings of ``from_generation_config``'s ``source`` and how to name it."""
  if isinstance(source, Mapping):
    return source, "the generation config"
  if not isinstance(source, (str, os.PathLike)):
    raise ValueError(f"source={source!r} must be a checkpoint directory, a "
                     "generation_config.json path or a mapping of its settings")
  path = os.path.expanduser(os.fspath(source))
  if os.path.isdir(path):
    path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(path):
      return {}, path  # a checkpoint without one: transformers' defaults (greedy)
  if not os.path.isfile(path):
    raise ValueError(f"source={os.fspath(source)!r}: no such directory or file")
  return read_json_object(path, "generation config"), path


def request_keys(seed_S: jax.Array, fork_S: jax.Array, index_S: jax.Array) -> jax.Array:
  """PRNG keys ``fold_in(fold_in(key(seed), fork), index)`` per row.

  Args:
    seed_S: u32[S] each request's seed.
    fork_S: i32[S] completion index within the request (0 .. n-1).
    index_S: i32[S] request-local index of the token being drawn (0 = first generated).
  """

  def one(seed, fork, index):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), fork), index)

  return jax.vmap(one)(seed_S.astype(jnp.uint32), fork_S.astype(jnp.int32),
                       index_S.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adjustments:
  """What ``adjust`` reads of each row besides its logits (``sample``'s ``adjustments``).

  Attributes:
    tokens_SJ: i32[S, J] each row's history: its prompt at ``[0, prompt_len)``, what it
      generated at ``[prompt_len, len)``; past ``len`` ignored.
    len_S, prompt_len_S: i32[S].
    repetition_penalty_S: f32[S] (1: none) over the prompt and the generated tokens:
      positive logits divided by it, the others multiplied.
    presence_penalty_S, frequency_penalty_S: f32[S] (0: none) over the generated tokens:
      ``- presence * (count > 0) - frequency * count``.
    barred_Si: i32[S, i] ids (negative: none) set to -inf in the rows where ``bar_S`` (the
      stop ids before ``min_tokens``).
    bar_S: bool[S].
    rows_S: bool[S] the rows whose tokens are drawn, or None (all): ``sample`` builds the
      [S, V] counts only when one of them asks for a penalty (not for a prefill under way
      or a finished request), the [S, V] bias only when one of them has a logit bias.
    bias_ids_Sb: i32[S, b] ids (negative: none; distinct in a row) whose logits get
      ``bias_Sb`` added before anything else (``SamplingParams.logit_bias``; in a row of
      ``allowed_only_S``, its ``allowed_token_ids``), or None.
    bias_Sb: f32[S, b] their biases, or None.
    allowed_only_S: bool[S] the rows that may draw only the ids of ``bias_ids_Sb`` (their
      ``SamplingParams.allowed_token_ids``; every other logit -inf before the bias is
      added; such a row lists at least one id, or every logit is -inf), or None (none).
  """

  tokens_SJ: jax.Array
  len_S: jax.Array
  prompt_len_S: jax.Array
  repetition_penalty_S: jax.Array
  presence_penalty_S: jax.Array
  frequency_penalty_S: jax.Array
  barred_Si: jax.Array
  bar_S: jax.Array
  rows_S: jax.Array | None = None
  bias_ids_Sb: jax.Array | None = None
  bias_Sb: jax.Array | None = None
  allowed_only_S: jax.Array | None = None

  def penalized_S(self) -> jax.Array:
    """bool[S]: the rows (of ``rows_S``) whose penalties are not all neutral."""
    on_S = ((self.repetition_penalty_S != 1) | (self.presence_penalty_S != 0)
            | (self.frequency_penalty_S != 0))
    return on_S if self.rows_S is None else on_S & self.rows_S

  def biased_S(self) -> jax.Array:
    """bool[S]: the rows (of ``rows_S``) with a logit bias or allowed tokens."""
    if self.bias_ids_Sb is None:
      return jnp.zeros(self.bar_S.shape, jnp.bool_)
    on_S = jnp.any(self.bias_ids_Sb >= 0, axis=-1)
    if self.allowed_only_S is not None:
      on_S = on_S | self.allowed_only_S
    return on_S if self.rows_S is None else on_S & self.rows_S


def adjust(logits_SV: jax.Array, adjustments: Adjustments, *,
           penalize: bool = True) -> jax.Array:
  """f32[S, V]: the logits as each row's bias and history change them (``SamplingParams``'
  fields of the same names; ``Adjustments``): the tokens a row does not allow at -inf and
  the logit bias added, then the penalties, then the bar; jit-able. ``penalize`` (static)
  False: the allowed ids, the bias and the bar only, without building the [S, V] counts
  (every row's penalties neutral)."""
  a = adjustments
  num_rows, vocab = logits_SV.shape
  logits_SV = jnp.asarray(logits_SV, jnp.float32)
  if a.bias_ids_Sb is not None:
    # Set (the ids of a row are distinct) into zeros, then added: XLA turns an add of a
    # scatter-ADD into zeros into a scatter-add into the caller's logits, which copies them.
    bias_ids_Sb = jnp.where(a.bias_ids_Sb >= 0, a.bias_ids_Sb, vocab)
    row_Sb = jnp.broadcast_to(jnp.arange(num_rows)[:, None], bias_ids_Sb.shape)
    # A row that allows only its ids starts at -inf: its ids (all it allows) get their bias.
    base_S1 = (jnp.zeros((num_rows, 1), jnp.float32) if a.allowed_only_S is None else
               jnp.where(a.allowed_only_S[:, None], -jnp.inf, 0.0).astype(jnp.float32))
    logits_SV = logits_SV + jnp.broadcast_to(base_S1, (num_rows, vocab)).at[
        row_Sb, bias_ids_Sb].set(a.bias_Sb.astype(jnp.float32), mode="drop")
  elif a.allowed_only_S is not None:
    raise ValueError("adjustments.allowed_only_S needs bias_ids_Sb (the ids the rows allow)")
  barred_Si = jnp.where(a.bar_S[:, None] & (a.barred_Si >= 0), a.barred_Si, vocab)
  row_Si = jnp.broadcast_to(jnp.arange(num_rows)[:, None], barred_Si.shape)
  if penalize:  # a new array: the bar writes into it
    logits_SV = _penalized(logits_SV, a.tokens_SJ, a.len_S, a.prompt_len_S,
                           a.repetition_penalty_S, a.presence_penalty_S,
                           a.frequency_penalty_S)
    return logits_SV.at[row_Si, barred_Si].set(-jnp.inf, mode="drop")
  # The caller's logits are read, not written (a scatter into them copies them when the
  # caller reads them again).
  barred_SV = jnp.zeros((num_rows, vocab), jnp.bool_).at[row_Si, barred_Si].set(
      True, mode="drop")
  return jnp.where(barred_SV, -jnp.inf, logits_SV)


def _penalized(logits_SV, tokens_SJ, len_S, prompt_len_S, repetition_penalty_S,
               presence_penalty_S, frequency_penalty_S):
  num_rows, vocab = logits_SV.shape
  position_J = jnp.arange(tokens_SJ.shape[1])
  seen_SJ = position_J[None, :] < len_S[:, None]
  generated_SJ = seen_SJ & (position_J[None, :] >= prompt_len_S[:, None])
  row_SJ = jnp.broadcast_to(jnp.arange(num_rows)[:, None], tokens_SJ.shape)
  # Positions outside the history index past the vocabulary: their updates are dropped.
  count_SV = jnp.zeros((num_rows, vocab), jnp.int32).at[
      row_SJ, jnp.where(generated_SJ, tokens_SJ, vocab)].add(1, mode="drop")
  seen_SV = jnp.zeros((num_rows, vocab), jnp.bool_).at[
      row_SJ, jnp.where(seen_SJ, tokens_SJ, vocab)].set(True, mode="drop")
  penalty_S1 = repetition_penalty_S.astype(jnp.float32)[:, None]
  penalized_SV = jnp.where(logits_SV > 0, logits_SV / penalty_S1, logits_SV * penalty_S1)
  finite_max = jnp.finfo(jnp.float32).max  # a tiny penalty: no finite logit becomes +-inf
  penalized_SV = jnp.where(jnp.isfinite(logits_SV),
                           jnp.clip(penalized_SV, -finite_max, finite_max), logits_SV)
  logits_SV = jnp.where(seen_SV, penalized_SV, logits_SV)
  return (logits_SV - frequency_penalty_S.astype(jnp.float32)[:, None] * count_SV
          - presence_penalty_S.astype(jnp.float32)[:, None] * (count_SV > 0))


def truncate(scaled_SV: jax.Array, top_k_S: jax.Array, top_p_S: jax.Array,
             truncates_S: jax.Array) -> jax.Array:
  """Top-k then top-p: ``scaled_SV`` with everything below each row's smallest kept value
  at -inf, in the rows where ``truncates_S``; the other rows as they are (a row's draw never
  depends on another row's top-k or top-p). A top-p of 1 keeps every token (the cumulative
  mass of a long tail can round to 1 before its last tokens)."""
  vocab = scaled_SV.shape[-1]
  sorted_SV = -jnp.sort(-scaled_SV, axis=-1)  # descending
  k_S = jnp.where(top_k_S > 0, jnp.minimum(top_k_S, vocab), vocab)
  in_k_SV = jnp.arange(vocab)[None, :] < k_S[:, None]
  sorted_SV = jnp.where(in_k_SV, sorted_SV, -jnp.inf)
  probs_SV = jax.nn.softmax(sorted_SV, axis=-1)
  before_SV = jnp.cumsum(probs_SV, axis=-1) - probs_SV
  in_p_SV = (before_SV < top_p_S[:, None]) | (top_p_S >= 1)[:, None]
  num_keep_S = jnp.maximum(jnp.sum(in_p_SV & in_k_SV, axis=-1), 1)
  threshold_S = jnp.take_along_axis(sorted_SV, (num_keep_S - 1)[:, None], axis=-1)[:, 0]
  kept_SV = (scaled_SV >= threshold_S[:, None]) | ~truncates_S[:, None]
  return jnp.where(kept_SV, scaled_SV, -jnp.inf)


def min_p_filter(scaled_SV: jax.Array, min_p_S: jax.Array, filters_S: jax.Array) -> jax.Array:
  """Min-p: ``scaled_SV`` with every token less likely than ``min_p`` times its row's most
  likely one at -inf, in the rows where ``filters_S``; the other rows as they are. No sort:
  the ratio to the row's largest score, which top-k and top-p always keep, so applied after
  ``truncate`` it drops what it would drop before it."""
  row_max_S1 = jnp.max(scaled_SV, axis=-1, keepdims=True)
  ratio_SV = jnp.exp(scaled_SV - jnp.where(jnp.isfinite(row_max_S1), row_max_S1, 0.0))
  kept_SV = (ratio_SV >= min_p_S[:, None]) | ~filters_S[:, None]
  return jnp.where(kept_SV, scaled_SV, -jnp.inf)


def sample(logits_SV: jax.Array, temperature_S: jax.Array, top_k_S: jax.Array,
           top_p_S: jax.Array, key_S: jax.Array, *, min_p_S: jax.Array | None = None,
           adjustments: Adjustments | None = None) -> tuple[jax.Array, jax.Array]:
  """One token per row (module docstring for the semantics); jit-able.

  Args:
    logits_SV: [S, V] raw logits.
    temperature_S: f32[S] (0: greedy).
    top_k_S: i32[S] (0: off).
    top_p_S: f32[S] in (0, 1].
    key_S: [S] typed PRNG keys (``request_keys``).
    min_p_S: f32[S] in [0, 1] (0: off); None: off in every row.
    adjustments: the bias, penalties and bars to ``adjust`` the logits by before the draw;
      None: none. The [S, V] counts of the penalties are built only when some row (of
      ``adjustments.rows_S``) asks for one, the bias and the bars applied only when some
      row has a bias or is barred:
      a ``switch`` whose three branches each draw, so that no [S, V] array passes through
      it (XLA copies one that does, at every call).

  Returns:
    ``(tokens_S, logprobs_S)``: i32[S] and f32[S], the log-probability of each chosen token
    under ``log_softmax(logits)`` (the raw logits, adjusted or not).
  """
  if logits_SV.ndim != 2:
    raise ValueError(f"logits.shape={tuple(logits_SV.shape)} must be [S, V]")
  if not jnp.issubdtype(logits_SV.dtype, jnp.floating):
    raise ValueError(f"logits.dtype={logits_SV.dtype} must be a floating dtype")
  num_rows = logits_SV.shape[0]
  for name, x in (("temperature", temperature_S), ("top_k", top_k_S), ("top_p", top_p_S),
                  ("key", key_S), ("min_p", min_p_S)):
    if x is not None and x.shape != (num_rows,):
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be [S]=[{num_rows}]")
  logits_SV = logits_SV.astype(jnp.float32)
  logprobs_SV = jax.nn.log_softmax(logits_SV, axis=-1)
  draw = lambda x: _draw(x, temperature_S, top_k_S, top_p_S, key_S, min_p_S)
  if adjustments is None:
    tokens_S = draw(logits_SV)
  else:
    which = jnp.where(jnp.any(adjustments.penalized_S()), 2, jnp.where(
        jnp.any(adjustments.bar_S) | jnp.any(adjustments.biased_S()), 1, 0))
    tokens_S = jax.lax.switch(which, [
        lambda: draw(logits_SV), lambda: draw(adjust(logits_SV, adjustments, penalize=False)),
        lambda: draw(adjust(logits_SV, adjustments))])
  logprob_S = jnp.take_along_axis(logprobs_SV, tokens_S[:, None], axis=-1)[:, 0]
  return tokens_S, logprob_S


def top_logprobs(logits_SV: jax.Array, width: int = MAX_TOP_LOGPROBS
                 ) -> tuple[jax.Array, jax.Array]:
  """The ``width`` likeliest tokens of each row under ``log_softmax(logits)`` (``sample``'s
  logprobs): ``(ids_Sv, logprobs_Sv)``, i32 and f32 ``[S, width]``, most likely first (ties:
  the smaller id first); past the vocabulary, id -1 and log-prob -inf."""
  logits_SV = logits_SV.astype(jnp.float32)
  # The log-softmax's order is the logits' (a shift per row): rank those, shift k of them.
  top_Sv, ids_Sv = jax.lax.top_k(logits_SV, min(width, logits_SV.shape[-1]))
  logprobs_Sv = top_Sv - jax.nn.logsumexp(logits_SV, axis=-1, keepdims=True)
  pad = ((0, 0), (0, width - ids_Sv.shape[-1]))
  return (jnp.pad(ids_Sv.astype(jnp.int32), pad, constant_values=-1),
          jnp.pad(logprobs_Sv, pad, constant_values=-jnp.inf))


def _draw(logits_SV, temperature_S, top_k_S, top_p_S, key_S, min_p_S) -> jax.Array:
  """i32[S]: ``sample``'s tokens from ``logits_SV`` (float32)."""
  greedy_S = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
  hot_S = temperature_S > 0
  # Shifted by the row's maximum first (softmax does not change): a tiny temperature then
  # sends the other logits to -inf, not the largest ones to +inf, where the draw would
  # take the first of them instead of the argmax.
  max_S = jnp.max(logits_SV, axis=-1)
  shifted_SV = logits_SV - jnp.where(jnp.isfinite(max_S), max_S, 0.0)[:, None]
  scaled_SV = shifted_SV / jnp.where(hot_S, temperature_S, 1.0)[:, None]

  truncates_S = hot_S & ((top_k_S > 0) | (top_p_S < 1))
  min_p_on_S = hot_S & (min_p_S > 0) if min_p_S is not None else None

  def draw():
    # The sort over V only runs when some sampled row asks for top-k or top-p; min-p needs
    # only each row's largest score (the one token top-k and top-p always keep).
    masked_SV = jax.lax.cond(jnp.any(truncates_S),
                             lambda x: truncate(x, top_k_S, top_p_S, truncates_S),
                             lambda x: x, scaled_SV)
    if min_p_S is not None:
      masked_SV = jax.lax.cond(jnp.any(min_p_on_S),
                               lambda x: min_p_filter(x, min_p_S, min_p_on_S),
                               lambda x: x, masked_SV)
    return jax.vmap(jax.random.categorical)(key_S, masked_SV).astype(jnp.int32)

  # Random draws (S x V of them) only when some row samples: an all-greedy batch skips them.
  drawn_S = jax.lax.cond(jnp.any(hot_S), draw, lambda: greedy_S)
  return jnp.where(hot_S, drawn_S, greedy_S)
