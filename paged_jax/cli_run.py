"""``paged-jax run``: serve a synthetic workload (or a prompt) and print a serving report.

With no arguments it serves ``paged_jax.workload.Workload()`` (64 requests, log-normal prompt
and output lengths, all at once or arriving at ``--request-rate`` through a session) on an
embedded tiny Llama with seeded random weights (no download);
``--model DIR`` serves a Hugging Face checkpoint instead, ``--prompt TEXT`` generates from
text where the checkpoint has a tokenizer, printing the completion as it streams. Hook it up
with ``add_run_parser(subparsers)``.
"""

from __future__ import annotations

import collections
import math
import sys
import time
import warnings

from paged_jax._words import count

TINY_LLAMA = dict(model_type="llama", vocab_size=256, embed_dim=128, mlp_dim=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, max_seq_len=512, bos_token_id=1,
                  eos_token_ids=(2,))
"""The embedded demo model: 2 layers, width 128, vocab 256, GQA 4:2, head dim 32."""

_FLOAT32_MAX = 3.4028234663852886e38  # the sampler's temperature is a float32
_FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal (repetition penalty)


def add_run_parser(subparsers) -> None:
  """Add the ``run`` subcommand (``func`` returns the exit code)."""
  from paged_jax.workload import Workload
  w = Workload()
  p = subparsers.add_parser(
      "run", help="serve a workload and print a report: a tiny embedded model (default) or a "
      "checkpoint (--model DIR)",
      description="Continuous-batching serving run. Without --model: a tiny Llama (2 layers, "
      "width 128, vocab 256) with seeded random weights serves a synthetic workload of "
      "log-normal prompt and output lengths, all at once or arriving over time "
      "(--request-rate). Every device-call shape is compiled (or loaded "
      "from the compilation cache) before serving is timed.")
  p.add_argument("--model", help="Hugging Face checkpoint directory to serve (default: the "
                 "embedded tiny Llama)")
  p.add_argument("--prompt", help="generate from this text instead of the synthetic workload, "
                 "printing the completion as it comes (needs --model with a tokenizer.json; "
                 "default: none)")
  # The workload's options default to None (Workload's values, filled in by _workload_args)
  # so that --prompt can refuse them when given.
  p.add_argument("--num-requests", type=int, default=None,
                 help=f"synthetic requests (default {w.num_requests})")
  p.add_argument("--prompt-median", type=int, default=None,
                 help=f"median prompt length (default {w.prompt_median})")
  p.add_argument("--output-median", type=int, default=None,
                 help=f"median output length (default {w.output_median})")
  p.add_argument("--sigma", type=float, default=None,
                 help=f"log-normal sigma of both lengths (default {w.prompt_sigma})")
  p.add_argument("--request-rate", type=float, default=None, metavar="R",
                 help="requests arrive as a Poisson process at R per second (seeded by "
                 "--seed) and join the running batch as they come; the report gives each "
                 "one's wait for its first token (default: all arrive at once)")
  p.add_argument("--seed", type=int, default=0,
                 help="workload, weight and sampling seed (default 0; request i samples "
                 "with seed + i)")
  p.add_argument("--max-tokens", type=int, default=None,
                 help="tokens to generate for --prompt (default 32); the synthetic workload "
                 "draws each request's output length instead (--output-median)")
  p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                 help="end --prompt's completion where its text reaches TEXT, which is not "
                 "printed (repeatable; a newline in bash: --stop $'\\n'; default: none)")
  p.add_argument("--chat", action="store_true",
                 help="send --prompt as a user's message laid out by the checkpoint's chat "
                 "template (an instruct or chat model expects it; default: the raw text)")
  p.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="K",
                 help="serve only the last K tokens of --prompt (the tokenizer's BOS kept "
                 "among them; -1: the most max_model_len takes; default: the whole prompt, "
                 "refused when too long)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="sampling temperature of every request (default 0: greedy)")
  p.add_argument("--top-k", type=int, default=0,
                 help="sample among the k most likely tokens (default 0: all)")
  p.add_argument("--top-p", type=float, default=1.0,
                 help="nucleus sampling mass (default 1.0: all)")
  p.add_argument("--min-p", type=float, default=0.0,
                 help="when sampling, drop the tokens less likely than MIN_P times the most "
                 "likely one (default 0: none)")
  p.add_argument("--repetition-penalty", type=float, default=1.0,
                 help="transformers' repetition penalty on the ids of the prompt and the "
                 "output, greedy too (default 1.0: none)")
  p.add_argument("--presence-penalty", type=float, default=0.0,
                 help="OpenAI's presence penalty on the generated ids, in [-2, 2] "
                 "(default 0: none)")
  p.add_argument("--frequency-penalty", type=float, default=0.0,
                 help="OpenAI's frequency penalty on the generated ids, in [-2, 2] "
                 "(default 0: none)")
  p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
  p.add_argument("--num-blocks", type=int, default=None,
                 help="KV pool size in blocks (default 64 for the tiny model: small enough "
                 "that the long tail forces a few preemptions; for --model, the whole "
                 "context of every sequence)")
  p.add_argument("--kv-budget", default=None, metavar="BYTES",
                 help="KV pool size as memory, e.g. 64MiB, instead of --num-blocks (default: "
                 "none); a model with sliding-window layers then puts them in KV groups "
                 "that give blocks back behind the window")
  p.add_argument("--max-seqs", type=int, default=16, help="concurrent sequences (default 16)")
  p.add_argument("--max-tokens-per-step", type=int, default=256,
                 help="token budget of one step (default 256)")
  p.add_argument("--steps-per-call", type=int, default=32,
                 help="scheduling steps per device call (default 32)")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                 help="model dtype (default float32 for the tiny model, the checkpoint's "
                 "otherwise)")
  p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                 help="what the KV pool stores: a float dtype, or int8 / float8_e4m3fn / "
                 "float8_e5m2 (one byte per value plus a float32 scale per token and KV head; "
                 "about twice the sequences of bfloat16) (default: the model dtype)")
  p.add_argument("--compilation-cache", default=None, metavar="DIR",
                 help="persistent compilation cache directory, or off (also: '', 0, false, "
                 "no, none; ./none names a directory so called); given, it "
                 "replaces $JAX_COMPILATION_CACHE_DIR (default: $JAX_COMPILATION_CACHE_DIR, "
                 "else $PAGED_JAX_COMPILATION_CACHE, else ~/.cache/paged_jax/jax)")
  p.add_argument("--no-progress", action="store_true",
                 help="no progress lines on stderr (default: progress on)")
  p.set_defaults(func=_run)


_MAX_ARRIVAL_SPAN_S = 86400  # --num-requests / --request-rate: a run's expected arrivals span

KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2")


def _say(enabled: bool, message: str) -> None:
  if enabled:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


class _Progress:
  """Serving progress on stderr: requests done, tokens, tokens/s; a line at most every
  ``every_s`` seconds (and at the end), so a log shows steady progress, not bursts. On a
  terminal each line overwrites the last (``\\r``); in a file or a pipe each is a line."""

  def __init__(self, total: int, enabled: bool, every_s: float = 0.5):
    self.total, self.enabled, self.every_s = total, enabled, every_s
    self.overwrite = getattr(sys.stderr, "isatty", lambda: False)()
    self.done = self.tokens = 0
    self.t0 = time.perf_counter()
    self.last = 0.0  # the first line after every_s: a rate over a moment means nothing
    self.trace = []  # (seconds since start, tokens so far) at every update

  def update(self, done: int, tokens: int) -> None:
    self.done, self.tokens = done, tokens
    now = time.perf_counter() - self.t0
    self.trace.append((now, tokens))
    if self.enabled and (now - self.last >= self.every_s or done == self.total):
      self.last = now
      rate = tokens / now if now > 0 else 0.0
      line = (f"  served {done}/{self.total} requests, {count(tokens, 'token')}, "
              f"{rate:.0f} tokens/s, {now:.1f} s")
      sys.stderr.write(f"\r{line} " if self.overwrite else line + "\n")
      sys.stderr.flush()

  def close(self) -> None:
    if self.enabled and self.overwrite:
      sys.stderr.write("\n")
      sys.stderr.flush()

  def steady_tokens_per_s(self, burst_gap_s: float = 1e-3) -> float:
    """Tokens/s between 10% and 90% of the tokens served: the ramp-up of the first
    admissions and the drain of the last requests left out. Tokens arrive in bursts, one
    per device call (updates closer than ``burst_gap_s`` are one burst); the rate is taken
    between the arrivals of bursts, and is 0 (not reported) when the window holds fewer
    than two device calls' worth of tokens."""
    bursts = []  # [arrival time, tokens so far at its end]
    last_t = None
    for t, n in self.trace:
      if last_t is not None and t - last_t < burst_gap_s:
        bursts[-1][1] = n
      else:
        bursts.append([t, n])
      last_t = t
    if self.tokens < 10 or len(bursts) < 3:
      return 0.0
    lo, hi = 0.1 * self.tokens, 0.9 * self.tokens
    i = next(k for k, (_, n) in enumerate(bursts) if n >= lo)
    j = next(k for k, (_, n) in enumerate(bursts) if n >= hi)
    if j - i < 2 or bursts[j][0] <= bursts[i][0]:
      return 0.0
    return (bursts[j][1] - bursts[i][1]) / (bursts[j][0] - bursts[i][0])


def _engine(args):
  budget = _kv_budget_bytes(args)
  opts = dict(block_size=args.block_size, num_blocks=args.num_blocks, kv_budget_bytes=budget,
              max_seqs=args.max_seqs,
              max_tokens_per_step=args.max_tokens_per_step, steps_per_call=args.steps_per_call,
              kv_cache_dtype=args.kv_cache_dtype, compilation_cache=True)
  if args.compilation_cache is not None:  # given: it wins over JAX_COMPILATION_CACHE_DIR
    from paged_jax import compile_cache
    chosen = compile_cache.enable(args.compilation_cache, override=True,
                                  name="--compilation-cache")
    opts["compilation_cache"] = chosen is not None  # the engine keeps what was just set
  # The engine warns when the pool caps max_model_len; the report says so in its notes.
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="max_model_len=", category=UserWarning)
    return _build_engine(args, opts, budget)


def _build_engine(args, opts: dict, budget):
  import jax.numpy as jnp
  from paged_jax.engine import LLM
  try:
    if args.model:
      return LLM.from_pretrained(args.model, dtype=args.dtype, **opts)
    from paged_jax.models import ModelConfig, init_random
    config = ModelConfig(**TINY_LLAMA)
    dtype = jnp.float32 if args.dtype is None else jnp.dtype(args.dtype)
    model = init_random(config, seed=args.seed, dtype=dtype)
    if opts["num_blocks"] is None and budget is None:
      opts["num_blocks"] = 64
    return LLM(model, config, **opts)
  except ValueError as e:  # a budget under one block of this model: named as the option
    message = str(e)
    if not message.startswith("kv_budget_bytes="):
      raise
    raise ValueError(f"--kv-budget={args.kv_budget} ({budget} bytes)"
                     + message[message.index(" "):]) from None


def describe_device(model) -> str:
  """Where the run serves and which attention kernel: ``"cpu, attention xla (auto)"``,
  ``"NVIDIA H200 (gpu), attention pallas_gpu (auto)"``, ``"4 x TPU v5 lite (tpu), ..."``.
  The kernel is what ``impl`` resolves to on this backend (a call may still pass over a
  kernel that refuses its shapes, see ``paged_attention``); a model without an ``impl``
  attribute (your own) is reported as "auto"."""
  import jax
  from paged_jax.attention import resolve_impl
  device = jax.devices()[0]
  kind, platform = str(device.device_kind), str(device.platform)
  where = platform if kind.lower() == platform.lower() else f"{kind} ({platform})"
  if jax.device_count() > 1:
    where = f"{jax.device_count()} x {where}"
  impl = getattr(model, "impl", "auto")
  try:
    chosen = resolve_impl(impl)
  except ValueError:
    chosen = str(impl)
  return f"{where}, attention {chosen}" + (" (auto)" if impl == "auto" else "")


def format_report(stats: dict, *, title: str, compile_s: float | None = None,
                  steady_tokens_per_s: float | None = None, notes=(),
                  device: str | None = None, waits: dict | None = None,
                  busy_s: float | None = None) -> str:
  """The serving report printed by ``paged-jax run``; ``waits``: ``serve_arrivals``'
  seconds per request, summarised; ``busy_s``: the engine's time in device calls, when the
  serving time (``stats["wall_s"]``) also holds waits for arrivals."""
  from paged_jax.planner import format_bytes
  rows = []
  if device is not None:
    rows.append(("device", device))
  if compile_s is not None:
    cached = compile_s.note() if isinstance(compile_s, _Precompiled) else ""
    rows.append(("compile time", f"{compile_s:.2f} s (before serving; not counted "
                                 f"below{cached})"))
  rows += [
      ("requests", f"{stats['requests']}"),
      ("generated tokens", f"{stats['generated_tokens']}"),
      ("serving time", f"{stats['wall_s']:.2f} s" + ("" if busy_s is None else
                                                      " (first arrival to last token)")),
      *([] if busy_s is None else [("engine busy", f"{busy_s:.2f} s ({_share(busy_s, stats)} "
                                    "of the serving time; the rest waited for arrivals)")]),
      ("tokens/s", f"{stats['tokens_per_s']:.1f} (generated tokens / serving time)"),
  ]
  if steady_tokens_per_s:
    rows.append(("steady tokens/s", f"{steady_tokens_per_s:.1f} (between 10% and 90% of the "
                 "tokens: no ramp-up, no drain)"))
  if waits is not None and waits["ttft_s"]:
    import numpy as np
    for name, key, what in (("time to first token", "ttft_s", "from each request's arrival"),
                            ("request latency", "latency_s", "arrival to its last token")):
      p50, p90, top = np.percentile(waits[key], (50, 90, 100))
      rows.append((name, f"p50 {p50:.3f} s, p90 {p90:.3f} s, max {top:.3f} s ({what})"))
  free = stats["num_free_blocks"]
  leak = ("all blocks free at the end: no leak" if free == stats["num_blocks"] else
          f"{stats['num_blocks'] - free} blocks still held")
  rows += [
      ("requests/s", f"{stats['requests_per_s']:.2f}"),
      ("KV pool", f"{count(stats['num_blocks'], 'block')} of {stats['block_size']} tokens, "
                  f"{_pool_dtype(stats['kv_cache_dtype'])}, "
                  f"{format_bytes(stats['kv_pool_bytes'])}"),
      *_kv_groups_rows(stats),
      ("KV blocks free", f"{free} at the end ({leak})"),
      ("peak blocks in use", f"{stats['peak_blocks_in_use']}"),
      ("mean blocks in use", f"{stats['mean_blocks_in_use']:.1f}"),
      ("KV utilisation", f"{stats['kv_utilization']:.1%} (tokens stored / slots of blocks "
                         "in use, mean over steps)"),
      ("preemptions", f"{stats['preemptions']}"),
      ("prefix hit rate", f"{stats['prefix_hit_rate']:.1%}" + _prefix_caching_note(stats)),
      ("engine steps", f"{stats['steps']} in {count(stats['device_calls'], 'device call')}"),
      ("host syncs", f"{stats['host_syncs']}"),
      ("host syncs per token", f"{stats['host_syncs_per_token']:.3f}"),
  ]
  rows += [("note", n) for n in notes]
  width = max(len(k) for k, _ in rows)
  return "\n".join([title] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _share(seconds: float, stats) -> str:
  return f"{seconds / max(stats['wall_s'], 1e-9):.0%}"


def _kv_groups_rows(stats) -> list:
  """The report's KV groups row, when the pool serves several (sliding windows freed)."""
  windows = tuple(stats.get("kv_group_windows", (None,)))
  if len(windows) == 1 and windows[0] is None:
    return []
  parts = [f"{n} full" if w is None else f"{n} sliding (window {w})"
           for w, n in collections.Counter(windows).items()]
  return [("KV groups", f"{len(windows)}: {', '.join(parts)}, one block table each; sliding "
                        "groups give blocks back behind the window")]


def _prefix_caching_note(stats) -> str:
  """Why the hit rate is 0 by construction, when it is: prefix caching is off."""
  if stats.get("prefix_caching", True):
    return ""
  from paged_jax import allocator  # after the engine: JAX is loaded by then
  if not allocator.supports_prefix_caching(stats.get("kv_group_windows", (None,))):
    return " (prefix caching off: every layer has a sliding window)"
  return " (prefix caching off)"


def _pool_dtype(name: str) -> str:
  from paged_jax.pallas_kernels import layout  # after the engine: JAX is loaded by then
  if layout.is_quantized(name):
    return f"{name} with a float32 scale per token and KV head"
  return name


def _kv_budget_bytes(args) -> int | None:
  """``--kv-budget`` in bytes (None when not given); a ``ValueError`` naming the option."""
  if args.kv_budget is None:
    return None
  from paged_jax.planner import parse_bytes
  return parse_bytes(args.kv_budget, name="--kv-budget")


def _check_args(args) -> None:
  if args.kv_budget is not None and args.num_blocks is not None:
    raise ValueError(f"--kv-budget={args.kv_budget} and --num-blocks={args.num_blocks}: "
                     "give at most one (both size the KV pool)")
  if _kv_budget_bytes(args) == 0:  # an unreadable or empty size is refused before JAX loads
    raise ValueError(f"--kv-budget={args.kv_budget} must hold one KV block at least")
  if args.max_tokens is not None and args.prompt is None:
    raise ValueError(f"--max-tokens={args.max_tokens} applies to --prompt only; the synthetic "
                     "workload draws each request's output length (set --output-median)")
  if args.stop is not None and args.prompt is None:
    raise ValueError(f"--stop={args.stop[0]!r} applies to --prompt only; the synthetic "
                     "workload's requests end at their drawn lengths")
  if args.chat and args.prompt is None:
    raise ValueError("--chat applies to --prompt only (the synthetic workload is token ids)")
  if args.chat and args.truncate_prompt_tokens is not None:
    raise ValueError(f"--truncate-prompt-tokens={args.truncate_prompt_tokens} with --chat "
                     "would cut the laid-out conversation's start (its BOS and header): give "
                     "a shorter --prompt")
  if args.truncate_prompt_tokens is not None and args.prompt is None:
    raise ValueError(f"--truncate-prompt-tokens={args.truncate_prompt_tokens} applies to "
                     "--prompt only; the synthetic workload's prompts fit max_model_len")
  if args.truncate_prompt_tokens is not None and not (args.truncate_prompt_tokens >= 1
                                                      or args.truncate_prompt_tokens == -1):
    raise ValueError(f"--truncate-prompt-tokens={args.truncate_prompt_tokens} must be >= 1 "
                     "(the prompt's last that many tokens) or -1 (the most that fit)")
  if args.stop is not None and not all(args.stop):
    raise ValueError("--stop='' is empty: a stop string needs one character at least")
  if args.prompt is not None:
    for name in ("num_requests", "prompt_median", "output_median", "sigma", "request_rate"):
      if getattr(args, name) is not None:
        hint = "" if name == "request_rate" else " (set --max-tokens for its length)"
        raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} applies to the "
                         f"synthetic workload only; --prompt serves that one prompt{hint}")
  check_counts(args, ("num_requests", "prompt_median", "output_median", "block_size",
                      "max_seqs", "max_tokens_per_step", "steps_per_call", "num_blocks",
                      "max_tokens"))
  # The sampling and workload values, as SamplingParams and Workload would refuse them, but
  # named as options and before JAX loads or anything compiles.
  if not 0 <= args.seed < 2**32:
    raise ValueError(f"--seed={args.seed} must be an int in [0, 2**32)")
  if not (math.isfinite(args.temperature) and 0 <= args.temperature <= _FLOAT32_MAX):
    raise ValueError(f"--temperature={args.temperature} must be a finite number >= 0 (at "
                     f"most {_FLOAT32_MAX:.4g})")
  if args.top_k < 0:
    raise ValueError(f"--top-k={args.top_k} must be >= 0 (0: no top-k)")
  if not 0 < args.top_p <= 1:
    raise ValueError(f"--top-p={args.top_p} must be in (0, 1]")
  if not 0 <= args.min_p <= 1:
    raise ValueError(f"--min-p={args.min_p} must be in [0, 1]")
  if not (math.isfinite(args.repetition_penalty)
          and _FLOAT32_TINY <= args.repetition_penalty <= _FLOAT32_MAX):
    raise ValueError(f"--repetition-penalty={args.repetition_penalty} must be a finite "
                     f"number > 0 (at least {_FLOAT32_TINY:.4g}: the sampler divides in "
                     "float32)")
  for name in ("presence_penalty", "frequency_penalty"):
    if not -2 <= getattr(args, name) <= 2:
      raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be in [-2, 2]")
  check_sigma(args)
  rate = args.request_rate
  if rate is not None:
    if not (math.isfinite(rate) and rate > 0):
      raise ValueError(f"--request-rate={rate} must be a finite number > 0 (requests per "
                       "second)")
    from paged_jax.workload import Workload
    n = Workload().num_requests if args.num_requests is None else args.num_requests
    if n / rate > _MAX_ARRIVAL_SPAN_S:
      raise ValueError(f"--request-rate={rate:g}: {n} requests would take about {n / rate:.3g} "
                       f"s to arrive, more than a day ({_MAX_ARRIVAL_SPAN_S} s): raise the "
                       "rate or lower --num-requests")


def check_counts(args, names) -> None:
  """Options that count something (None: not given) must be >= 1, refused by their flags."""
  for name in names:
    value = getattr(args, name, None)
    if value is not None and value < 1:
      raise ValueError(f"--{name.replace('_', '-')}={value} must be >= 1")


def check_sigma(args) -> None:
  """``--sigma``, the log-normal length draw's spread (None: not given)."""
  if args.sigma is not None and not (math.isfinite(args.sigma) and args.sigma >= 0):
    raise ValueError(f"--sigma={args.sigma} must be a finite number >= 0")


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""The event JAX records when an executable is loaded from the persistent cache."""


class _Precompiled(float):
  """Seconds ``_precompile`` took (a float), with ``loaded``: how many of the ``calls``
  device calls came from the persistent compilation cache rather than a compilation."""

  loaded: int = 0
  calls: int = 0

  def note(self) -> str:
    if not self.calls:
      return ""
    return (f"; {self.loaded} of {count(self.calls, 'device call')} loaded from the "
            "compilation cache" if self.loaded else "; none loaded from the compilation cache")


def _precompile(llm, progress: bool) -> _Precompiled:
  """Compile every device-call shape the run will use, saying which; seconds taken, and
  how many came from the persistent compilation cache (JAX's cache-hit events)."""
  import jax
  t0 = time.perf_counter()
  hits, calls = [], [0]

  def on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT:
      hits.append(event)

  def say(i, n, what):
    calls[0] = n
    if i == 0:
      cached = (" (a warm compilation cache loads them instead)"
                if llm.compilation_cache_dir is not None else " (the compilation cache is off)")
      _say(progress, f"  {count(n, 'device call')} to compile{cached}:")
    _say(progress, f"  compiling {i + 1}/{n}: {what} (at {time.perf_counter() - t0:.1f} s)")

  jax.monitoring.register_event_listener(on_event)
  try:
    llm.precompile(progress=say)
  finally:
    jax.monitoring.unregister_event_listener(on_event)
  done = _Precompiled(time.perf_counter() - t0)
  done.loaded, done.calls = min(len(hits), calls[0]), calls[0]
  if done.loaded:
    _say(progress, f"  ready in {done:.1f} s: {done.loaded} of {done.calls} loaded from the "
         "compilation cache")
  return done


def _workload_args(args) -> None:
  """The workload options not given take ``Workload()``'s values."""
  from paged_jax.workload import Workload
  w = Workload()
  for name, value in (("num_requests", w.num_requests), ("prompt_median", w.prompt_median),
                      ("output_median", w.output_median), ("sigma", w.prompt_sigma)):
    if getattr(args, name) is None:
      setattr(args, name, value)


def _run(args) -> int:
  progress = not args.no_progress
  t_start = time.perf_counter()
  _check_args(args)
  _workload_args(args)
  _say(progress, "paged-jax run: loading JAX and building the engine ...")
  from paged_jax.sampling import SamplingParams
  from paged_jax.workload import Workload, arrival_times, make_requests, serve_arrivals
  try:
    llm = _engine(args)
  except Exception as e:  # jax's runtime error when the pool (or model) outgrows the device
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    first = str(e).strip().splitlines()[0]
    raise ValueError(f"the model, its KV pool and the state of --max-seqs={args.max_seqs} "
                     f"sequences do not fit the device's memory ({first}); lower --kv-budget "
                     "or --num-blocks, or --max-seqs") from None
  source = args.model or "embedded tiny Llama (random weights)"
  device = describe_device(llm.model)
  _say(progress, f"  {source}: {llm.stats['num_blocks']} KV blocks of {args.block_size} "
       f"tokens, up to {llm.max_seqs} sequences, on {device} "
       f"({time.perf_counter() - t_start:.1f} s)")
  if args.prompt is not None and llm.tokenizer is None:  # said before compiling, not after
    raise ValueError(f"--prompt needs a tokenizer: --model={args.model!r} has no "
                     "tokenizer.json beside its config.json" if args.model else
                     "--prompt needs --model DIR with a tokenizer.json (the embedded model "
                     "has no tokenizer)")
  neutral = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                 presence_penalty=0.0, frequency_penalty=0.0, seed=args.seed)
  sampling = {name: getattr(args, name) for name in neutral}
  if args.prompt is not None:  # an empty or too long prompt: said before compiling
    prompt_params = SamplingParams(max_tokens=32 if args.max_tokens is None
                                   else args.max_tokens, stop=tuple(args.stop or ()),
                                   truncate_prompt_tokens=args.truncate_prompt_tokens,
                                   **sampling)
    prompt = args.prompt
    if args.chat:
      from paged_jax.engine.chat import chat_prompts
      try:
        prompt, = chat_prompts(llm.tokenizer, llm.chat_template,
                               [{"role": "user", "content": args.prompt}])
      except ValueError as e:
        raise ValueError(f"--chat: {str(e).replace('pass chat_template=', 'drop --chat')}"
                         ) from None
    try:
      llm.check_requests([prompt], prompt_params)
    except ValueError as e:  # named as the options: the user typed no list of prompts
      message = str(e).replace("prompts[0]", "--prompt", 1).replace(
          "SamplingParams(truncate_prompt_tokens=-1)", "--truncate-prompt-tokens -1")
      raise ValueError(message.replace("truncate_prompt_tokens=",
                                       "--truncate-prompt-tokens=")) from None
  compile_s = _precompile(llm, progress)
  if args.prompt is not None:
    print(f"prompt:     {args.prompt}")
    print("completion: ", end="", flush=True)
    generated, finish_reason, stop_reason = 0, None, None
    for ev in llm.generate_stream([prompt], prompt_params):  # printed as it comes
      print(ev.text, end="", flush=True)
      generated += ev.token_id is not None
      if ev.token_id is None:  # the completion's end
        finish_reason, stop_reason = ev.finish_reason, ev.stop_reason
    print()
    if not generated and finish_reason == "stop" and not args.chat:
      print("            (none: the model's first token was its end of sequence; an instruct "
            "or chat model may expect its chat template around the prompt: --chat applies "
            "it)")
    why = "" if stop_reason is None else f" (at {stop_reason!r})"
    print(format_report(llm.stats, title=f"paged-jax run: 1 prompt, finish_reason "
                        f"{finish_reason}{why}", compile_s=compile_s, device=device))
    return 0
  default = Workload()
  max_prompt = min(default.max_prompt_len, llm.max_model_len // 2)
  max_output = min(default.max_output_len, llm.max_model_len // 2)
  notes = []
  if (max_prompt, max_output) != (default.max_prompt_len, default.max_output_len):
    bound = ("the model's context" if llm.max_model_len >= llm.config.max_seq_len
             else "what one sequence can hold in the KV pool")
    lowered = [f"{what} <= {cap} tokens (default {was})" for what, cap, was in (
        ("prompts", max_prompt, default.max_prompt_len),
        ("outputs", max_output, default.max_output_len)) if cap != was]
    notes.append(f"workload caps lowered to fit max_model_len={llm.max_model_len} ({bound}): "
                 + ", ".join(lowered))
  for option, median, cap in (("--prompt-median", args.prompt_median, max_prompt),
                              ("--output-median", args.output_median, max_output)):
    if median > cap:
      notes.append(f"{option} {median} is above the cap of {cap} tokens: most lengths are "
                   "clipped to the cap")
  workload = Workload(num_requests=args.num_requests, prompt_median=args.prompt_median,
                      prompt_sigma=args.sigma, output_median=args.output_median,
                      output_sigma=args.sigma, vocab_size=llm.config.vocab_size,
                      max_prompt_len=max_prompt, max_output_len=max_output, seed=args.seed,
                      request_rate=args.request_rate)
  prompts, params = make_requests(workload)
  if sampling != neutral:
    import dataclasses
    # One seed per request (--seed, --seed + 1, ...): samples of different requests are not
    # drawn from the same random stream.
    params = [dataclasses.replace(p, **dict(sampling, seed=(args.seed + i) % 2**32))
              for i, p in enumerate(params)]
  llm.reset_stats()
  arriving = args.request_rate is not None
  rate = f" arriving at {args.request_rate:g}/s" if arriving else ""
  arrivals_s = arrival_times(workload)
  over = f" (the last at {arrivals_s[-1]:.1f} s)" if arriving else ""
  _say(progress, f"  serving {count(len(prompts), 'request')}{rate}{over} ...")
  bar = _Progress(len(prompts), enabled=progress)
  waits = serve_arrivals(llm, prompts, params, arrivals_s, bar.update)
  bar.close()
  title = (f"paged-jax run: {count(len(prompts), 'synthetic request')}{rate} on {source}, "
           f"seed {args.seed}")
  stats, busy_s = llm.stats, None
  if arriving:  # the clock runs from the first arrival to the last token, waits included
    busy_s, span_s = stats["wall_s"], waits["span_s"]
    stats = dict(stats, wall_s=span_s, tokens_per_s=stats["generated_tokens"] / span_s,
                 requests_per_s=stats["requests"] / span_s)
  print(format_report(stats, title=title, compile_s=compile_s,
                      steady_tokens_per_s=bar.steady_tokens_per_s(), notes=notes,
                      device=device, waits=waits, busy_s=busy_s))
  return 0
