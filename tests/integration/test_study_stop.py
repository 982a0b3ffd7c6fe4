"""A SIGTERM to a study at a chosen phase: while the run it just launched is still starting
(importing torch, before the trainer handles signals). The run dies of the signal it was passed;
the study reports the stop it asked for (rerun to resume), not a failed run, and exits as a
handled stop does (0), with nothing outside the study folder touched."""

import os
import signal
import subprocess
import sys
import time

from tests.integration.test_study_run import ENV, ROOT

STUDY = """
[study]
config_file = "{preset}"
seeds = [0]
folder = "study"

[study.overrides]
"training.steps" = 2
"training.global_batch_size" = 4
"training.micro_batch_size" = 4
"training.seq_len" = 64
"metrics.enable_tensorboard" = false

[variants.A]
"model.num_loops" = 1
"""


def test_a_sigterm_while_the_run_imports_torch_is_a_stop_not_a_failure(tmp_path, outside):
    (tmp_path / "s.toml").write_text(
        STUDY.format(preset=ROOT / "train_configs" / "debug_model.toml")
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_loom.tools.study", "s.toml"],
        cwd=tmp_path,
        env=dict(os.environ, **ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the study checks every run (imports torch), then launches
        lines.append(line)
        if line.startswith("study: run 1 of 1: A seed 0 -> study/A/seed-0: new"):
            break
    time.sleep(0.3)  # the run is launched and the study forwards signals; the run's python is
    # still starting: its trainer installs its stop handlers only after importing torch
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    out = "".join(lines) + out
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert "failed" not in err and "Traceback" not in err, err
    assert "study: run 1 of 1 (study/A/seed-0) stopped after" in out, out[-2000:]
    assert "rerun the study to resume it" in out
    outside.check()
