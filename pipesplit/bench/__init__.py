"""Benchmarking splits: predicted against measured stage, step and memory figures per configuration."""

from pipesplit.bench.predict import Prediction, predict
from pipesplit.bench.result import BenchmarkResult, BenchRow
from pipesplit.bench.run import benchmark, mean_output_loss

__all__ = ["BenchRow", "BenchmarkResult", "Prediction", "benchmark", "mean_output_loss", "predict"]
