"""A new user's first and second `paged-jax run`, and the report against the request count.

Runs the console command as a user would (a subprocess: imports and all), with its own
empty compilation-cache directory:
- cold: the first run, which compiles every device call and writes the cache;
- warm: the same command again, which loads them (pairs alternate cold / warm over
  ``--rounds`` fresh cache directories);
- then ``--num-requests 16`` and ``--num-requests 128`` (warm), whose reported tokens/s
  should not depend on how many requests were served (goal: within 2x).

    python benchmarks/first_run.py            # prints the tables, writes the section
    python benchmarks/first_run.py --quick    # one round, 8 and 16 requests; never writes
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_PATH = pathlib.Path(__file__).with_name("first_run_RESULTS_section.md")


def run_cli(cache_dir: str, *args: str) -> dict:
  """Wall time of one ``paged-jax run`` and the figures of its report."""
  env = dict(os.environ, PAGED_JAX_COMPILATION_CACHE=cache_dir,
             PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "paged_jax.cli", "run", "--no-progress", *args],
                        env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
  wall = time.perf_counter() - t0
  if proc.returncode:
    raise RuntimeError(proc.stderr[-2000:])
  out = proc.stdout

  def figure(name):
    m = re.search(rf"^\s+{re.escape(name)}\s+([0-9.]+)", out, re.M)
    return float(m.group(1)) if m else float("nan")

  return dict(wall_s=wall, compile_s=figure("compile time"), serving_s=figure("serving time"),
              tokens_per_s=figure("tokens/s"), steady=figure("steady tokens/s"),
              tokens=figure("generated tokens"))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--rounds", type=int, default=None, help="cold/warm pairs (default 3)")
  args = ap.parse_args(argv)
  rounds = args.rounds or (1 if args.quick else 3)
  counts = (8, 16) if args.quick else (16, 128)
  cold, warm = [], []
  base = tempfile.mkdtemp(prefix="paged_jax_first_run_")
  try:
    for r in range(rounds):
      cache = os.path.join(base, f"cache{r}")
      cold.append(run_cli(cache))
      warm.append(run_cli(cache))
    by_count = {n: run_cli(os.path.join(base, "cache0"), "--num-requests", str(n))
                for n in counts}
  finally:
    shutil.rmtree(base, ignore_errors=True)
  med = lambda rows, key: statistics.median(r[key] for r in rows)
  lines = [f"`paged-jax run` (defaults: 64 requests, tiny Llama), {rounds} cold/warm pairs, "
           "each pair on its own empty cache directory; medians. Wall time is the whole "
           "command (Python start, imports, engine, compilation or cache load, serving).", "",
           "| start | wall time | compile time (report) | serving time | tokens/s |",
           "|---|---:|---:|---:|---:|"]
  for name, rows in (("cold (compiles, writes the cache)", cold),
                     ("warm (loads the cache)", warm)):
    lines.append(f"| {name} | {med(rows, 'wall_s'):.1f} s | {med(rows, 'compile_s'):.2f} s | "
                 f"{med(rows, 'serving_s'):.2f} s | {med(rows, 'tokens_per_s'):.0f} |")
  ratio = med(warm, "wall_s") / med(cold, "wall_s")
  lines += ["", f"warm / cold wall time: {ratio:.2f} (goal <= 0.33: {verdict(ratio <= 0.33)})",
            "",
            "| --num-requests | generated tokens | serving time | tokens/s | steady tokens/s |",
            "|---:|---:|---:|---:|---:|"]
  for n, row in by_count.items():
    lines.append(f"| {n} | {row['tokens']:.0f} | {row['serving_s']:.2f} s | "
                 f"{row['tokens_per_s']:.0f} | {_figure_or_na(row['steady'])} |")
  lo, hi = (by_count[n]["tokens_per_s"] for n in counts)
  quick = " (quick: too few requests for the goal's fixed costs; a plumbing check)" * args.quick
  lines += ["", f"tokens/s {counts[1]} / {counts[0]} requests: {hi / lo:.2f} (goal within 2x: "
            f"{verdict(0.5 <= hi / lo <= 2)}){quick}"]
  text = "\n".join(lines)
  print(text)
  if not args.quick:
    RESULTS_PATH.write_text(text + "\n\nCommand: `python benchmarks/first_run.py`\n")
  return dict(cold=cold, warm=warm, by_count=by_count)


def verdict(ok: bool) -> str:
  return "met" if ok else "MISSED"


def _figure_or_na(x: float) -> str:
  """A figure the report printed, or "n/a" where it left it out (NaN)."""
  return "n/a" if x != x else f"{x:.0f}"


if __name__ == "__main__":
  main()
