"""The state a step keeps and saves: checkpoints, the optimizer's state under the model's names, and state written in place inside the forward."""
