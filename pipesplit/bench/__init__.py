"""Benchmarking splits: predicted against measured stage, step and memory figures per configuration.

``pipesplit.benchmark`` (in :mod:`pipesplit.bench.run`) drives a sweep; this package's
parts predict a configuration and hold the results.
"""

from pipesplit.bench.predict import Prediction, predict
from pipesplit.bench.result import BenchmarkResult, BenchRow

__all__ = ["BenchRow", "BenchmarkResult", "Prediction", "predict"]
