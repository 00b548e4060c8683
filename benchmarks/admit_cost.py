"""Cost of admitting one request into a running engine: whole rows vs chunks of slots.

Admitting writes the new request's slot rows (its prompt in the ``[S, J]`` token history,
J = ``max_model_len``, a zeroed log-prob row, its sampling parameters) into the device
state. Until stop 40 the host built every slot's rows (``host_rows(S, J)``) and the device
merged them with ``jnp.where`` over the whole ``[S, J]`` history: about 8 bytes x S x J
uploaded and rewritten per admission, whatever was admitted. Now the host sends the
admitted slots' rows only, ``ADMIT_ROWS`` slots per ``admit`` call (``state.row_chunks``),
and the device scatters them in place: 8 bytes x ``ADMIT_ROWS`` x J.

Both run here side by side in one process, on the same engine state (``init_state`` of a
1-layer pool; the pool does not enter either), donated as the engine donates it: the old
merge is rebuilt below as the baseline. Each figure is the median over ``--repeats``
admissions of one 100-token request (host rows built, uploaded, merged, waited for),
alternating the two ways so that load from other jobs hits both alike.

    python benchmarks/admit_cost.py            # S in (16, 64, 256), J in (2k, 8k, 32k)
    python benchmarks/admit_cost.py --quick    # two small shapes, few repeats
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax import KVCacheSpec  # noqa: E402
from paged_jax.engine import state as state_lib  # noqa: E402

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, num_blocks=8,
                   dtype=jnp.float32)
PROMPT = list(range(3, 103))


def _whole_rows_merge(st, mask_S, rows):
  """The old admit: every slot's row, merged where ``mask_S``."""
  updates = {}
  for name in state_lib.ROW_FIELDS:
    old = getattr(st, name)
    m = mask_S.reshape((-1,) + (1,) * (old.ndim - 1))
    updates[name] = jnp.where(m, rows[name].astype(old.dtype), old)
  return dataclasses.replace(st, **updates)


_whole = jax.jit(_whole_rows_merge, donate_argnums=(0,))
_chunked = jax.jit(state_lib.admit, donate_argnums=(0,))


def _values(max_model_len: int) -> dict:
  return dict(tokens_SJ=PROMPT, len_S=len(PROMPT), prompt_len_S=len(PROMPT),
              max_len_S=max_model_len, status_S=state_lib.RUNNING, seed_S=7, top_p_S=1.0,
              stop_Si=[2], fresh_S=True)


def admit_whole(st, slot: int, num_slots: int, max_model_len: int):
  rows = state_lib.host_rows(num_slots, max_model_len)
  state_lib.fill_row(rows, slot, _values(max_model_len))
  mask = np.zeros(num_slots, bool)
  mask[slot] = True
  return _whole(st, *jax.device_put((mask, rows)))


def admit_chunked(st, slot: int, num_slots: int, max_model_len: int):
  for slot_r, rows in state_lib.row_chunks([(slot, _values(max_model_len))],
                                           max_model_len=max_model_len, shards=1,
                                           slots_per_shard=num_slots):
    st = _chunked(st, *jax.device_put((slot_r, rows)))
  return st


WAYS = {"whole rows": admit_whole, "chunked": admit_chunked}


def measure(num_slots: int, max_model_len: int, repeats: int) -> dict:
  states = {name: state_lib.init_state(SPEC, num_slots, max_model_len) for name in WAYS}
  times = {name: [] for name in WAYS}
  for i in range(repeats + 1):  # the first of each: compile
    for name, way in WAYS.items():
      t0 = time.perf_counter()
      states[name] = way(states[name], i % num_slots, num_slots, max_model_len)
      jax.block_until_ready(states[name])
      if i:
        times[name].append(time.perf_counter() - t0)
  for name in state_lib.ROW_FIELDS:  # both ways wrote the same state
    np.testing.assert_array_equal(np.asarray(getattr(states["whole rows"], name)),
                                  np.asarray(getattr(states["chunked"], name)), err_msg=name)
  whole, chunked = (statistics.median(times[name]) * 1e3 for name in WAYS)
  rows = min(state_lib.ADMIT_ROWS, num_slots)
  return dict(S=num_slots, J=max_model_len, whole_ms=whole, chunked_ms=chunked,
              speedup=whole / chunked, whole_mib=8 * num_slots * max_model_len / 2**20,
              chunked_mib=8 * rows * max_model_len / 2**20)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="two small shapes")
  parser.add_argument("--repeats", type=int, default=None)
  args = parser.parse_args(argv)
  if args.quick:
    shapes, repeats = [(16, 512), (64, 2048)], args.repeats or 5
  else:
    shapes = [(s, j) for s in (16, 64, 256) for j in (2048, 8192, 32768)]
    repeats = args.repeats or 21
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {platform.processor() or '?'};"
        f" ADMIT_ROWS {state_lib.ADMIT_ROWS}; median of {repeats} admissions")
  print(f"{'S':>5} {'J':>6} {'whole MiB':>10} {'chunk MiB':>10} {'whole ms':>9} "
        f"{'chunked ms':>11} {'speed-up':>9}")
  results = []
  for num_slots, max_model_len in shapes:
    r = measure(num_slots, max_model_len, repeats)
    results.append(r)
    print(f"{r['S']:>5} {r['J']:>6} {r['whole_mib']:>10.2f} {r['chunked_mib']:>10.2f} "
          f"{r['whole_ms']:>9.2f} {r['chunked_ms']:>11.2f} {r['speedup']:>8.1f}x", flush=True)
  return results


if __name__ == "__main__":
  main()
