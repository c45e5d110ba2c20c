"""Model building: synthetic long-context tasks, training, φ distillation, evaluation.

Built on ``workers`` (the model, prefill and decode methods); nothing that serves imports it.
"""
