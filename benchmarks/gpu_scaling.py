"""The continued-scaling study of SmolLM2-135M at 8K with real budgets, on a GPU.

Runs ``flexmoba continued-scaling`` with ``configs/pretrained/smollm2_scaling.yaml``'s arms and schedule,
training at ``--seq_len`` (8,192) for ``--budgets`` steps in bf16 on the GPU and scoring there, into
``--out``; then ``flexmoba continued-scaling-report`` into ``<out>/report``. Started again with the same
arguments it goes on where it stopped (a session's device time may end mid-study). Needs the imported
checkpoint (``make pretrained``: runs/pretrained/smollm2); without it the part is a SKIP.

    python -m benchmarks.gpu_scaling --out benchmarks/results/gpu/scaling
    python -m benchmarks.gpu_scaling --device cpu --seq_len 256 --budgets 2 4 --eval_seq_len 512 --out /tmp/s
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.common import OneLineArgumentParser
from benchmarks.gpu_mfu import flexmoba_command
from benchmarks.verdict import verdict

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "pretrained" / "smollm2_scaling.yaml"
CHECKPOINT = REPO / "runs" / "pretrained" / "smollm2" / "model.ckpt"


def study_command(args) -> list[str]:
    """The ``continued-scaling`` arguments of the GPU study (the config's, at the GPU's length and budgets)."""
    on_gpu = args.device == "cuda"
    command = ["continued-scaling", "--config", str(CONFIG), "--out", str(args.out),
               "--data.init_args.seq_len", str(args.seq_len), "--budgets", str(list(args.budgets)),
               "--eval_seq_len", str(args.eval_seq_len), "--eval_documents", str(args.eval_documents),
               "--retrieval_lengths", str([n for n in (4096, 8192) if n <= args.eval_seq_len]),
               "--eval_device", args.device, "--trainer.accelerator", "gpu" if on_gpu else "cpu",
               "--trainer.devices", "1", "--trainer.precision", "bf16-mixed" if on_gpu else "32-true"]
    if args.eval_seq_len < 8192:
        command += ["--eval_window", str(args.eval_seq_len // 16), "--eval_trailing", str(args.eval_seq_len // 32)]
    return command


def parse_args(argv=None):
    p = OneLineArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu" / "scaling",
                   help="the study's folder (default %(default)s, committed)")
    p.add_argument("--seq_len", type=int, default=8192, help="training sequence length")
    p.add_argument("--budgets", type=int, nargs="+", default=[125, 250, 500, 1000], help="optimizer steps")
    p.add_argument("--eval_seq_len", type=int, default=8192)
    p.add_argument("--eval_documents", type=int, default=20)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not CHECKPOINT.is_file():
        verdict("scaling", "SKIP", f"no {CHECKPOINT.relative_to(REPO)} (make pretrained imports it)")
        return
    for command in (study_command(args), ["continued-scaling-report", "--study", str(args.out),
                                          "--out", str(args.out / "report")]):
        done = subprocess.run([*flexmoba_command(), *command], cwd=REPO)
        if done.returncode:
            verdict("scaling", "FAIL", f"flexmoba {command[0]} exited {done.returncode}")
            raise SystemExit(1)
    first = (args.out / "report" / "results.md").read_text().splitlines()[2]
    verdict("scaling", "PASS", f"{first.removeprefix('Status: ')} (report in {args.out / 'report'})")


if __name__ == "__main__":
    sys.exit(main())
