"""A run that saves more often than it logs (a short study: every 2 steps, a step line every 10)
says its routine saves and prunes only at the steps it logs and at the last step; a run that saves
no more often than it logs says every one (issue 45)."""

import re

from torchtitan_loom import train


def run(pack, dump, log_freq: str, capsys) -> tuple[list[int], list[int], list[int]]:
    argv = [
        *("--data.path", str(pack), "--job.dump_folder", str(dump)),
        *("--training.seq_len", "32", "--training.global_batch_size", "4"),
        *("--training.micro_batch_size", "2", "--training.steps", "9"),
        *("--eval.interval", "0", "--metrics.enable_tensorboard", "false"),
        *("--checkpoint.enable", "true", "--checkpoint.interval", "2"),
        *("--checkpoint.keep_latest_k", "1", "--metrics.log_freq", log_freq),
    ]
    capsys.readouterr()
    assert train.main(argv) == 0
    out = capsys.readouterr().out

    def steps(pattern: str) -> list[int]:
        return [int(m) for m in re.findall(pattern, out)]

    return (
        steps(r"\] step +(\d+)/"),
        steps(r"checkpoint step (\d+) saved to"),
        steps(r"checkpoint step (\d+) proven by"),
    )


def test_routine_save_lines_follow_the_step_lines(tiny_pack, tmp_path, capsys):
    logged, saved, pruned = run(tiny_pack, tmp_path / "quiet", "4", capsys)
    assert logged == [4, 8, 9]
    assert saved == [4, 8, 9] and set(pruned) <= {4, 8}, (saved, pruned)
    logged, saved, pruned = run(tiny_pack, tmp_path / "every", "1", capsys)
    assert logged == list(range(1, 10)) and saved == [2, 4, 6, 8, 9] and pruned, (saved, pruned)
