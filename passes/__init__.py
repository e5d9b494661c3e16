"""Compiler passes over torch.fx graphs: cost annotation, partitioning and splitting."""

if __name__ != "pipesplit.passes":  # imported as top-level `passes` from a checkout
    raise ImportError("import this package as `pipesplit.passes`, not as top-level `passes`")
