"""Compiled code: stages compiled by ``torch.compile``, their explicit F/I/W graphs, CUDA graph slots, and what compiled stages cannot take."""
