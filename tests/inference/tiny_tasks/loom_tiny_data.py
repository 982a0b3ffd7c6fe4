"""Loads the task's jsonl next to this file (independent of the working directory)."""

import json
import os

import datasets


def _load(name):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load(**_kwargs):
    return _load("loom_tiny_mc.jsonl")


def load_story(**_kwargs):
    return _load("loom_story_mc.jsonl")
