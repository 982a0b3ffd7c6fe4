"""The trainer's room: one launch's training, from the built parts to the end of the loop.

    parts.py   the typed parts: Setting (what the launch gives), ModelParts, TrainingParts,
               Services, and TrainerParts holding them with the step
    build.py   the builders, in TorchTitan's order, each returning the part it makes; ``build``
    step.py    SegmentedStep over StepParts: LOOM's segmented step (LOOM_SPEC §6 with §14)
    loop.py    Trainer: owns the parts; resume, the loop, the end

``python -m torchtitan_loom.train`` (train.py) hands argv and ``Trainer`` to ``launch.run``.
"""

from torchtitan_loom.trainer.loop import Trainer
from torchtitan_loom.trainer.parts import TrainerParts

__all__ = ["Trainer", "TrainerParts"]
