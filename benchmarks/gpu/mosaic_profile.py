"""Where the Mosaic GPU kernel's programs spend their cycles: a summary of the traces that
``pallas_kernels.mosaic_gpu.profiled_attention`` writes (the Mosaic GPU profiler).

A trace holds, per program (one warpgroup: a trace ``tid``; its SM: ``pid``), a begin and
an end event for every named region it ran (``kernel.region``: prologue; per chunk pages,
wait, stage, scores, softmax, update, refill; epilogue). Event times are
``(globaltimer ns at the program's start + SM clock cycles since its first event) / 1e3``,
so a difference of two events of one program is kilo-cycles.

``summarise`` turns one trace into per-region figures (cycles per occurrence, share of the
programs' time) plus the cycles per chunk and how many programs ran side by side on one
SM; ``to_markdown`` prints them. Run on a GPU by ``benchmarks/gpu/run.py`` (its last
stage); the summary is tested on a synthetic trace, the profiler itself only runs there.
"""

from __future__ import annotations

import collections
import json
import pathlib

# SM clock of an H200 under load (GHz), only to place a program's end on the globaltimer
# axis when counting programs that overlap on one SM (an estimate; durations stay cycles).
CLOCK_GHZ = 1.98
# The region counted once per chunk a program walks.
CHUNK_REGION = "wait"


def load_trace(path) -> dict:
  """The JSON trace at ``path``."""
  return json.loads(pathlib.Path(path).read_text())


def newest_trace(folder) -> pathlib.Path:
  """The last trace written into ``folder`` (file names start with a ns timestamp)."""
  traces = sorted(pathlib.Path(folder).glob("*-trace.json"))
  if not traces:
    raise FileNotFoundError(f"no *-trace.json in {folder}")
  return traces[-1]


def summarise(trace: dict) -> dict:
  """Per-region and per-program figures of one trace.

  Returns a dict: ``programs``; ``regions``: name -> {count, per_program, mean_cycles,
  share} (share: the region's cycles over the programs' cycles from their first event to
  their last); ``cycles_per_program`` (mean); ``chunks_per_program`` and
  ``cycles_per_chunk`` (by the ``wait`` region, once per chunk); ``max_programs_per_sm``
  (most programs whose estimated spans overlap on one SM); ``kernel_us``: from the first
  program's start to the last one's estimated end (its cycles at ``CLOCK_GHZ``), to set
  beside the call's measured time (the rest is the XLA work around the kernel).
  """
  by_program = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    by_program[(event["pid"], event["tid"])].append(event)
  totals = collections.defaultdict(float)
  counts = collections.Counter()
  spans = []
  starts_by_sm = collections.defaultdict(list)
  for (sm, _), events in by_program.items():
    events.sort(key=lambda e: e["ts"])
    open_regions = []
    for event in events:
      if event["ph"] == "B":
        open_regions.append(event)
        continue
      while open_regions and open_regions[-1]["name"] != event["name"]:
        open_regions.pop()  # an unmatched begin (a corrupt trace): dropped
      if not open_regions:
        continue
      begin = open_regions.pop()
      totals[event["name"]] += (event["ts"] - begin["ts"]) * 1e3
      counts[event["name"]] += 1
    span = (events[-1]["ts"] - events[0]["ts"]) * 1e3
    spans.append(span)
    starts_by_sm[sm].append((events[0]["ts"] * 1e3, span / CLOCK_GHZ))
  programs = len(by_program)
  all_cycles = sum(spans)
  regions = {
      name: dict(count=counts[name], per_program=counts[name] / programs,
                 mean_cycles=totals[name] / counts[name],
                 share=totals[name] / all_cycles if all_cycles else float("nan"))
      for name in sorted(totals, key=lambda n: -totals[n])}
  chunks = counts[CHUNK_REGION] / programs if programs else 0.0
  intervals = [iv for ivs in starts_by_sm.values() for iv in ivs]
  kernel_ns = (max(s + n for s, n in intervals) - min(s for s, _ in intervals)
               if intervals else float("nan"))
  return dict(programs=programs, regions=regions,
              cycles_per_program=all_cycles / programs if programs else float("nan"),
              chunks_per_program=chunks, kernel_us=kernel_ns / 1e3,
              cycles_per_chunk=(all_cycles / counts[CHUNK_REGION]
                                if counts[CHUNK_REGION] else float("nan")),
              max_programs_per_sm=max((_most_overlapping(v) for v in starts_by_sm.values()),
                                      default=0))


def _most_overlapping(intervals) -> int:
  """Most of the (start ns, length ns) intervals that hold one instant."""
  edges = sorted([(s, 1) for s, _ in intervals] + [(s + n, -1) for s, n in intervals])
  most = live = 0
  for _, step in edges:
    live += step
    most = max(most, live)
  return most


def to_markdown(label: str, summary: dict) -> str:
  """``summarise``'s figures as a paragraph and a table of regions."""
  plural = "" if summary["programs"] == 1 else "s"
  lines = [f"Profile {label}: {summary['programs']} program{plural}, "
           f"{summary['chunks_per_program']:.1f} chunks and "
           f"{summary['cycles_per_program']:.0f} cycles each "
           f"({summary['cycles_per_chunk']:.0f} per chunk), up to "
           f"{summary['max_programs_per_sm']} programs at once on one SM; kernel ~"
           f"{summary['kernel_us']:.1f} us (cycles at {CLOCK_GHZ} GHz).", "",
           "| region | per program | cycles each | share of program time |",
           "|---|---|---|---|"]
  for name, r in summary["regions"].items():
    lines.append(f"| {name} | {r['per_program']:.1f} | {r['mean_cycles']:.0f} | "
                 f"{r['share']:.1%} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> None:
  """Print the summary of each trace named, or of the newest trace in each folder named
  (``run.py`` writes them under ``$OUT/profile/``)."""
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("traces", nargs="+", metavar="TRACE_OR_FOLDER",
                      help="a trace file of profiled_attention, or a folder holding them")
  for name in parser.parse_args(argv).traces:
    path = pathlib.Path(name)
    path = newest_trace(path) if path.is_dir() else path
    print(to_markdown(str(path), summarise(load_trace(path))))


if __name__ == "__main__":
  main()
