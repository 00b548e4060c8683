"""benchmarks/gpu_window_pages.py --quick runs and shows the window's page count flat."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_gpu_window_pages_quick(capsys):
  from benchmarks import gpu_window_pages
  rows = gpu_window_pages.main(["--quick"])
  assert [row["context"] for row in rows] == list(gpu_window_pages.QUICK_CONTEXTS)
  # W = 256 over Z = 16 at contexts that are multiples of 16: 16 pages for a decode row,
  # whatever the context; without a window every page of the context.
  assert {row["decode_window"] for row in rows} == {256 // 16}
  assert [row["decode_full"] for row in rows] == [row["context_pages"] for row in rows]
  assert "| context |" in capsys.readouterr().out
