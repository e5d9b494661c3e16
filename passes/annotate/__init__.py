"""Annotate: every node of the captured graph gets its costs (``pipesplit.meta.NodeCost``).

``costs`` counts parameter and activation bytes and FLOPs (forward, input- and weight-gradient,
with the formulas of ``flops``); ``rates`` measures the device so the default cost prices FLOPs,
bytes and per-op overhead in seconds; ``profile`` times every node, and ``calibrate`` fits
FLOP and byte prices to such a profile (``cost="hybrid"``).
"""
