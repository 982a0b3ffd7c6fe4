"""Training metrics: JSONL + TensorBoard (+ optional wandb) logger, console line, tokens/s, TFLOP/s and MFU, memory.

Scalar names used by the trainer (all optional except ``step``): ``loss``, ``loss_segment_j``,
``lr``, ``grad_norm``, ``tokens_per_s``, ``tflops``, ``mfu`` (percent), ``skipped``, memory keys
from ``memory_stats``, ``eval_loss``, ``eval_loss_loop_t``, and at eval the routing-diversity and
stream scalars ``routing_*`` / ``stream_*`` of ``components/observability/routing_stats.py``; at diagnostic
steps ``diag/…`` (``components/observability/diagnostics.py``) and at downstream steps ``downstream/<task>/<metric>``
(``components/evaluation/downstream.py``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import time
import warnings
from typing import IO, TYPE_CHECKING, Any

import torch

from torchtitan_loom.components.checkpoint import names
from torchtitan_loom.components.runtime import safe_files

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

# Dense bf16 peak FLOP/s by GPU name substring, most specific names first (first match wins).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("A100", 312e12),
    ("B200", 2250e12),
    ("L40S", 362e12),
    ("MI300X", 1307e12),
)

_GIB = float(1 << 30)
# TensorBoard stops (one warning) when its disk has less than this left: its writer thread would
# otherwise die on the full disk with a thread traceback and no file named. A step's events are
# a few hundred bytes.
TB_MIN_FREE_BYTES = 256 << 10


def peak_flops_for_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a device name (case-insensitive substring match), else None."""
    lowered = name.lower()
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in lowered:
            return flops
    return None


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of ``device``; None on CPU or for a GPU missing from the table.

    An unknown GPU triggers a ``UserWarning`` (Python's warning filter shows it once per call
    site), so MFU is reported as null rather than against a guessed peak.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    flops = peak_flops_for_name(name)
    if flops is None:
        warnings.warn(
            f"unknown GPU {name!r}: no peak FLOP/s in the table, MFU will be null", stacklevel=2
        )
    return flops


def throughput(
    tokens: float, seconds: float, flops_per_token: float, peak: float | None
) -> dict[str, float | None]:
    """{"tokens_per_s", "tflops" achieved, "mfu" percent of ``peak`` (None without a peak)}.

    The one formula of the trainer's log line and of the benchmarks. ``flops_per_token`` is the
    model's training FLOPs per token (forward + backward) for the work done per token.
    """
    tokens_per_s = tokens / max(seconds, 1e-9)
    achieved = tokens_per_s * flops_per_token
    return {
        "tokens_per_s": tokens_per_s,
        "tflops": achieved / 1e12,
        "mfu": None if not peak else 100.0 * achieved / peak,
    }


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB since the previous call.

    CUDA: ``memory_max_allocated_gib`` and ``memory_max_reserved_gib`` from the caching
    allocator, whose peaks are then reset. CPU: ``memory_max_rss_gib``, the process's peak
    resident set size from ``resource.getrusage`` (a lifetime peak; the OS cannot reset it).
    """
    device = torch.device(device)
    if device.type == "cuda":
        stats = {
            "memory_max_allocated_gib": torch.cuda.max_memory_allocated(device) / _GIB,
            "memory_max_reserved_gib": torch.cuda.max_memory_reserved(device) / _GIB,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    import resource  # Unix only; imported here so the module still imports elsewhere

    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bytes_per_unit = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return {"memory_max_rss_gib": max_rss * bytes_per_unit / _GIB}


def tb_tag(name: str) -> str:
    """TensorBoard tag of a scalar: a name with a ``/`` is its own tag (``diag/…``,
    ``downstream/…``); ``eval_x`` → ``eval/x``, ``routing_x`` → ``routing/x``, ``stream_x`` →
    ``stream/x``, anything else ``x`` → ``train/x``.

    E.g. ``loss`` → ``train/loss``, ``loss_segment_2`` → ``train/loss_segment_2``,
    ``eval_loss_loop_3`` → ``eval/loss_loop_3``, ``routing_overlap`` → ``routing/overlap``. The
    prefix groups the charts in the UI.
    """
    if "/" in name:
        return name
    for prefix in ("eval", "routing", "stream"):
        if name.startswith(prefix + "_"):
            return prefix + "/" + name[len(prefix) + 1 :]
    return "train/" + name


def launch_dir(root: str) -> str:
    """A new ``<root>/<YYYYmmdd-HHMMSS>`` (``-1``, ``-2``... appended when taken): one per launch."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(root, stamp), 0
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{stamp}-{n}")
    return path


class MetricsLogger:
    """Writes one JSON line per ``log`` call to ``<dump_folder>/<jsonl_name>`` and the numeric
    scalars to TensorBoard under ``<dump_folder>/<tb_folder>/<launch>/`` (one sub-folder per launch,
    so a resumed or restarted run never interleaves with an earlier event stream; TensorBoard pointed
    at ``<tb_folder>`` shows every launch as its own run) and, with ``enable_wandb``, to a Weights &
    Biases run (same scalars and tags; its files under ``<dump_folder>/wandb``). Only
    ``rank == log_rank`` writes anything (other ranks create no files). The JSONL file is opened in
    append mode so a resumed run continues the same file.
    """

    def __init__(
        self,
        dump_folder: str,
        section: Any,
        *,
        jsonl_name: str = names.METRICS_JSONL,
        rank: int = 0,
        run_id: str | None = None,
        wandb_config: dict | None = None,
    ) -> None:
        """``section``: the ``[metrics]`` config section (enable_tensorboard, tb_folder, log_rank, enable_wandb)."""
        enable_tensorboard, tb_folder, enable_wandb = (
            section.enable_tensorboard,
            section.tb_folder,
            section.enable_wandb,
        )
        self.active = rank == section.log_rank
        self.run_id = run_id  # written into every JSON line: one id per launch
        self._launch_note: dict[str, Any] = {}
        self.dump_folder = dump_folder
        self.jsonl_path = os.path.join(dump_folder, jsonl_name)
        self.tb_dir = (
            launch_dir(os.path.join(dump_folder, tb_folder)) if enable_tensorboard else None
        )
        self._jsonl: IO[str] | None = None
        self._writer: SummaryWriter | None = None
        self._wandb: Any = None
        if not self.active:
            return
        os.makedirs(dump_folder, exist_ok=True)
        # O_NOFOLLOW | O_APPEND: bound to the run's own file, whatever is planted at the name later.
        self._jsonl = safe_files.open_append(self.jsonl_path, dump_folder)
        # TensorBoard's folder and event file wait for the first scalar: a launch refused at its
        # resume (every checkpoint damaged, say) leaves no empty event file behind.
        self._tb_open = self.tb_dir is not None
        if enable_wandb:
            import wandb  # optional: validate.py checked that it is installed

            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "torchtitan_loom"),
                dir=dump_folder,
                config=wandb_config or {},
            )

    def log(
        self, step: int, scalars: dict[str, float | int | None], extra: dict | None = None
    ) -> None:
        """Append ``{"step": step, **scalars, **extra}`` as one JSON line (flushed at once) and
        write every non-None numeric scalar to TensorBoard at ``step`` (tags from ``tb_tag``).

        None stays null; 0-d tensors become numbers; tensors in ``extra`` become nested lists.
        Non-finite floats are written as NaN/Infinity (Python's json reads them back).
        """
        if not self.active:
            return
        extra = extra or {}
        clash = ({"step"} & (set(scalars) | set(extra))) | (set(scalars) & set(extra))
        if clash:
            raise ValueError(f"MetricsLogger.log: duplicate metric names {sorted(clash)}")
        values = {k: _to_number(k, v) for k, v in scalars.items()}
        record = {"step": int(step), **values, **{k: _to_json(v) for k, v in extra.items()}}
        if self.run_id is not None:
            record["run_id"] = self.run_id
        record.update(self._launch_note)
        self._launch_note = {}
        assert self._jsonl is not None, "MetricsLogger.log after close"
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        except OSError as exc:  # a full disk, say: name the file (a failed flush names none)
            raise OSError(exc.errno, exc.strerror, self.jsonl_path) from None
        writer = self._writer if self._tb_safe() else None  # _tb_safe opens the writer
        if writer is not None:
            try:
                for name, value in values.items():
                    if value is not None:
                        writer.add_scalar(tb_tag(name), value, global_step=int(step))
                writer.flush()
            except OSError as exc:  # its writer thread failed (a disk filled since the check)
                self._tb_stop(exc)
        if self._wandb is not None:
            self._wandb.log(
                {tb_tag(k): v for k, v in values.items() if v is not None}, step=int(step)
            )

    @property
    def writes_images(self) -> bool:
        """Whether log_image writes anything (this rank logs and TensorBoard is on)."""
        return self.active and self._tb_open

    def log_image(self, tag: str, image_CHW: Any, step: int) -> None:
        """One uint8 RGB image [3, h, w] to TensorBoard under ``tag`` (no-op without a writer)."""
        writer = self._writer if self._tb_safe() else None  # _tb_safe opens the writer
        if writer is None:
            return
        try:
            writer.add_image(tag, image_CHW, global_step=int(step), dataformats="CHW")
            writer.flush()
        except OSError as exc:
            self._tb_stop(exc)

    def _tb_safe(self) -> bool:
        """Whether TensorBoard may write now. Its writer reopens the event file by name at every
        flush, so a link planted on the way (tb/, the launch folder, the file) since the last
        write stops TensorBoard for this launch, with one warning (nothing pending is flushed)."""
        if not (self.active and self._tb_open):
            return False
        tb_dir = self.tb_dir
        assert tb_dir is not None  # _tb_open starts true only with a tb_dir
        try:
            if self._writer is None:  # the first write of this launch
                from torch.utils.tensorboard import SummaryWriter  # heavy import, only when used

                safe_files.make_dirs(tb_dir, self.dump_folder)  # refuses a tb/ planted as a link
                self._writer = SummaryWriter(log_dir=tb_dir)
            safe_files.check_inside(tb_dir, self.dump_folder)
            disk = os.statvfs(tb_dir)
            if disk.f_bavail * disk.f_frsize < TB_MIN_FREE_BYTES:
                raise OSError(
                    errno.ENOSPC,
                    f"its disk is full ({disk.f_bavail * disk.f_frsize >> 10} KiB left)",
                    tb_dir,
                )
            links = [e.path for e in os.scandir(tb_dir) if e.is_symlink()]
            if links:
                raise safe_files.UnsafePathError(
                    f"{links[0]} is a symbolic link; refusing to write through it"
                )
        except OSError as exc:
            self._tb_stop(exc)
            return False
        return True

    def _tb_stop(self, exc: OSError) -> None:
        self._writer, self._tb_open = None, False  # dropped, not closed: a close would flush
        where = f"{exc.filename}: " if exc.filename else ""
        why = f"{where}{exc.strerror}" if exc.strerror else str(exc)
        print(f"warning: TensorBoard stopped for this launch: {why}", file=sys.stderr, flush=True)

    def mark_launch(self, resumed_from_step: int | None) -> None:
        """The next JSON line carries ``"launch": {"resumed_from_step": N}`` (null: a fresh start):
        where a relaunch picked up, so two histories in one file are never silently interleaved."""
        self._launch_note = {"launch": {"resumed_from_step": resumed_from_step}}

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _to_number(name: str, value: Any) -> float | int | None:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if value is None or isinstance(value, (int, float)):  # bool is an int: logged as 0/1
        return int(value) if isinstance(value, bool) else value
    try:
        return float(value)  # numpy scalars and the like
    except (TypeError, ValueError):
        raise ValueError(
            f"metric {name!r} must be a number or None, got {type(value).__name__}"
        ) from None


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value


def format_duration(seconds: float) -> str:
    """'42 s', '3 min 12 s', '5 h 03 min' (the README's spelling of durations)."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def format_console_line(
    step: int, scalars: dict[str, Any], total: int | None = None, eta_s: float | None = None
) -> str:
    """One compact line: step (of ``total``), loss (per-segment losses), lr, grad norm, tokens/s,
    TFLOP/s, MFU, memory, eval loss and the ETA, each shown only when present and not None."""

    def has(key: str) -> bool:
        return scalars.get(key) is not None

    parts = [f"step {step:>6d}" + ("" if total is None else f"/{total}")]
    if has("loss"):
        parts.append(f"loss {scalars['loss']:.4f}")
    seg = sorted(
        (int(m.group(1)), v)
        for k, v in scalars.items()
        if (m := re.fullmatch(r"loss_segment_(\d+)", k)) and v is not None
    )
    if seg:
        parts.append("seg " + "/".join(f"{v:.3f}" for _, v in seg))
    if has("lr"):
        parts.append(f"lr {scalars['lr']:.2e}")
    if has("grad_norm"):
        parts.append(f"gnorm {scalars['grad_norm']:.3f}")
    if has("tokens_per_s"):
        parts.append(f"{scalars['tokens_per_s']:,.0f} tok/s")
    if has("tflops"):
        parts.append(f"{scalars['tflops']:.2f} TFLOP/s")
    if has("mfu"):
        parts.append(f"mfu {scalars['mfu']:.1f}%")
    for key in ("memory_max_allocated_gib", "memory_max_rss_gib"):
        if has(key):
            parts.append(f"mem {scalars[key]:.2f} GiB")
            break
    if has("eval_loss"):
        parts.append(f"eval {scalars['eval_loss']:.4f}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    if scalars.get("skipped"):
        parts.append("SKIPPED")
    return " | ".join(parts)
