"""Scoring a model: held-out loss, downstream tasks (lm-eval adapter), sampling."""
