"""Keys that act only while a switch is on: the one table of them, and what a run does when one is
given with its switch off. Given on the command line it is refused (the user asked for something
that would not happen); read from a config file it is named once at the start (a preset may set
``compile.mode`` that a ``--compile.enable false`` turns off: refusing would break the preset).
``checkpoint.load_step``, ``initial_load_path`` and ``exit_after_step`` are refused from either
source, by value (section_checks.checkpoint_errors): they change what a launch resumes or when it
stops, so a preset that sets them with checkpoints off is a mistake."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan_loom.config.manager import CLI, section_fields, section_types
from torchtitan_loom.config.schema import JobConfig


@dataclass(frozen=True)
class Gate:
    switches: tuple[str, ...]
    """The dotted keys that turn the feature on: any one of them true (a flag) or > 0 (a count)."""
    keys: tuple[str, ...] = ()
    """Dotted keys it gates; with ``section``, every key of the section but ``keep``."""
    section: str = ""
    keep: tuple[str, ...] = ()

    def gated(self, cfg: JobConfig) -> tuple[str, ...]:
        if not self.section:
            return self.keys
        fields = section_fields(section_types(cfg)[self.section])
        return tuple(f"{self.section}.{k}" for k in fields if k not in self.keep)

    def on(self, cfg: JobConfig) -> bool:
        return any(_value(cfg, k) for k in self.switches)  # True, or a count > 0

    def switch(self, cfg: JobConfig) -> str:
        """The switch as a message says it: ``compile.enable = true``, ``metrics.diag_interval >
        0``, ``profiling.enable_profiling or enable_memory_snapshot = true``."""
        first, *more = self.switches
        names = " or ".join([first, *(k.split(".", 1)[1] for k in more)])
        return f"{names} = true" if isinstance(_value(cfg, first), bool) else f"{names} > 0"


def _value(cfg: JobConfig, dotted: str) -> Any:
    sec, key = dotted.split(".", 1)
    return getattr(getattr(cfg, sec), key)


GATES = (
    Gate(
        ("checkpoint.enable",),
        section="checkpoint",
        # save_on_signal also says how a signal stops a run without checkpoints; the other three
        # are refused by value (the module docstring).
        keep=("enable", "save_on_signal", "load_step", "initial_load_path", "exit_after_step"),
    ),
    Gate(("compile.enable",), section="compile", keep=("enable",)),
    Gate(("float8.enable",), section="float8", keep=("enable",)),
    Gate(("spike_guard.enable",), section="spike_guard", keep=("enable",)),
    Gate(
        ("profiling.enable_profiling", "profiling.enable_memory_snapshot"),
        ("profiling.profile_freq", "profiling.profiler_warmup", "profiling.profiler_active"),
    ),
    Gate(("profiling.enable_profiling",), ("profiling.save_traces_folder",)),
    Gate(("profiling.enable_memory_snapshot",), ("profiling.save_memory_snapshot_folder",)),
    Gate(
        ("metrics.diag_interval",),
        ("metrics.diag_activations", "metrics.diag_rank", "metrics.diag_grad"),
    ),
    Gate(
        ("eval.downstream_interval",),
        (
            "eval.downstream_tasks",
            "eval.downstream_tasks_dir",
            "eval.downstream_only_tasks_dir",
            "eval.downstream_limit",
            "eval.downstream_batch_size",
        ),
    ),
    Gate(("metrics.enable_tensorboard",), ("metrics.tb_folder", "metrics.routing_images")),
)


def gated_problems(cfg: JobConfig) -> tuple[list[str], list[str]]:
    """(errors, notes): a key given with its switch off, refused when the command line gave it,
    noted when a file did (one note per switch, naming its keys and the file)."""
    errors: list[str] = []
    notes: dict[tuple[str, str], list[str]] = {}
    for gate in GATES:
        if gate.on(cfg):
            continue
        turned_off = any(cfg.given.get(k) == CLI for k in gate.switches)
        switch = gate.switch(cfg)
        for key in gate.gated(cfg):
            origin = cfg.given.get(key)
            if origin == CLI and not turned_off:
                errors.append(f"{key} is given but has no effect: it needs {switch}")
            elif origin is not None:
                notes.setdefault((switch, origin), []).append(key)
    return errors, [
        f"without effect ({switch} is not set): {', '.join(keys)} from {origin}"
        for (switch, origin), keys in notes.items()
    ]
