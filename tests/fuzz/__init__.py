"""Differential fuzzing: random models and configurations through pipesplit against plain PyTorch."""
