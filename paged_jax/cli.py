"""The paged-jax console script."""

from __future__ import annotations

import argparse
import os
import sys

from paged_jax.cli_run import KV_CACHE_DTYPES, add_run_parser, check_counts, check_sigma


def _add_plan(subparsers) -> None:
  p = subparsers.add_parser(
      "plan", help="KV capacity planner: blocks, tokens and sequences that fit a budget",
      description="How many sequences fit a KV memory budget, paged against contiguous "
      "max-length reservation. Without --config it plans for a Llama-3-8B shape "
      "(L=32, K=8, D=128, bfloat16) in 16 GiB.")
  p.add_argument("--config", help="a Hugging Face config.json, or the checkpoint directory "
                 "(default: a Llama-3-8B shape)")
  p.add_argument("--num-layers", type=int, help="override L (default: from the config)")
  p.add_argument("--num-kv-heads", type=int, help="override K (default: from the config)")
  p.add_argument("--head-dim", type=int, help="override D (default: from the config)")
  p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                 help="model dtype (default: the config's)")
  p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                 help="what the KV pool stores; int8 / float8 count their float32 scales "
                 "(default: --dtype)")
  p.add_argument("--budget", default="16GiB", help="KV memory budget, e.g. 16GiB (default)")
  p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
  p.add_argument("--max-len", type=int, default=4096,
                 help="declared maximum sequence length (default 4096)")
  p.add_argument("--median-len", type=int, default=512,
                 help="median of the log-normal length distribution (default 512)")
  p.add_argument("--sigma", type=float, default=1.0,
                 help="sigma of the log-normal length distribution (default 1.0)")
  p.add_argument("--seed", type=int, default=0, help="seed of the length draw (default 0)")
  p.set_defaults(func=_plan)


def _check_plan_args(args) -> None:
  """Plan's numeric options refused by their own names (the planner's messages name its
  arguments: ``max_len=0``)."""
  check_counts(args, ("block_size", "max_len", "median_len", "num_layers", "num_kv_heads",
                      "head_dim"))
  if args.seed < 0:
    raise ValueError(f"--seed={args.seed} must be >= 0")
  check_sigma(args)


def _plan(args) -> int:
  from paged_jax import planner  # imported here: the CLI parses (and --help answers) at once
  _check_plan_args(args)
  from paged_jax.spec import MAX_SLOTS, KVCacheSpec
  model = planner.model_shape_from_config(args.config) if args.config else planner.LLAMA3_8B
  overrides = {k: v for k, v in (("num_layers", args.num_layers),
                                 ("num_kv_heads", args.num_kv_heads),
                                 ("head_dim", args.head_dim),
                                 ("dtype", args.dtype))
               if v is not None}
  if overrides:  # the model line says what the options changed
    overrides["name"] = f"{model.name} with " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in overrides.items())
  if args.dtype is not None:  # chosen: the config's dtype, known or not, no longer applies
    overrides["unknown_dtype"] = None
  if (args.num_layers is not None and args.num_layers != model.num_layers
      and model.layer_types):
    overrides["layer_types"] = ()  # the config's per-layer kinds no longer apply
    overrides["notes"] = model.notes + (
        f"--num-layers {args.num_layers} differs from the config's {model.num_layers} "
        "layers: its per-layer sliding-window pattern no longer applies, every layer is "
        "planned as full attention",)
  if overrides:
    model = planner.dataclasses.replace(model, **overrides)
  budget = planner.parse_bytes(args.budget, name="--budget")
  kv_dtype = args.kv_cache_dtype or model.dtype  # the pool's; the model line keeps its own
  block = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, args.block_size,
                      1, kv_dtype).block_bytes
  if budget < block:
    raise ValueError(f"--budget={args.budget} is smaller than one KV block ({block} bytes at "
                     f"--block-size {args.block_size})")
  if budget // block * args.block_size > MAX_SLOTS:
    raise ValueError(f"--budget={args.budget} holds {budget // block} KV blocks of "
                     f"{args.block_size} tokens, more than int32 slot ids address "
                     f"({MAX_SLOTS} slots)")
  spec = KVCacheSpec.from_budget(budget, model.num_layers, model.num_kv_heads, model.head_dim,
                                 args.block_size, kv_dtype)
  dist = planner.LengthDistribution(median_len=args.median_len, sigma=args.sigma,
                                    max_len=args.max_len, seed=args.seed)
  print(planner.format_plan(planner.plan_capacity(spec, dist), model, budget))
  if any(w is not None for w in planner.layer_windows(model)):
    print()
    print(planner.format_windowed(planner.plan_windowed(model, budget, args.block_size, dist,
                                                        dtype=kv_dtype)))
  return 0


def _version() -> str:
  """The installed distribution's version, read from its metadata: loads no JAX."""
  from importlib import metadata
  try:
    return metadata.version("paged-jax")
  except metadata.PackageNotFoundError:  # run from a source tree that pip never installed
    from paged_jax._version import __version__
    return __version__


def build_parser() -> argparse.ArgumentParser:
  """The ``paged-jax`` parser: ``run`` and ``plan`` subcommands, ``--version``."""
  parser = argparse.ArgumentParser(
      prog="paged-jax", description="Paged attention for JAX: serve a model with a paged KV "
      "cache (run) or plan KV capacity for a memory budget (plan).")
  parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
  subparsers = parser.add_subparsers(dest="command", required=True)
  add_run_parser(subparsers)
  _add_plan(subparsers)
  return parser


def main(argv: list[str] | None = None) -> int:
  """The ``paged-jax`` console script: parse ``argv`` (``sys.argv[1:]`` when None), run the
  subcommand; a bad argument exits 2 with one error line."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    code = args.func(args)
    sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
    return code
  except (ValueError, FileNotFoundError) as e:
    parser.exit(2, f"paged-jax {args.command}: error: {e}\n")
  except BrokenPipeError:  # `paged-jax plan | head`: the reader left; exit quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
  except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT
    sys.stdout.flush()
    sys.stderr.write(f"paged-jax {args.command}: interrupted\n")
    sys.stderr.flush()
    # Not a normal exit: JAX torn down while a compilation runs crashes the interpreter
    # (SIGSEGV, exit 139, after a long traceback).
    os._exit(130)


if __name__ == "__main__":
  sys.exit(main())
