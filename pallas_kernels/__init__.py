"""Ragged paged attention kernels. Imports nothing from ``paged_jax`` or ``models``.

Every implementation shares one signature::

    fn(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S, block_tables_SP, cu_q_lens,
       num_seqs, *, sm_scale, ...) -> [T, H, D]

with the page layout of ``pallas_kernels.layout`` and ``reference`` as the oracle.
"""
