"""Differential fuzzing: random models and configurations through pipesplit against plain PyTorch.

``python -m tests.fuzz --minutes N --seed S`` (``--include-known`` to draw KNOWN's combinations);
``tests/fuzz/test_fuzz.py`` runs a fixed-seed budget in the suite; ``tests/fuzz/dist.py`` runs under
torchrun. models.py: the model as data -> source -> module; configs.py: configurations and KNOWN;
harness.py: one case against gradient accumulation (self-contained: repros carry it); check.py:
running, counting, repro scripts, the hypothesis strategy.
"""
