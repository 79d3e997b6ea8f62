"""Every script in examples/ runs as written, as a user would run it."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_ddp_train_runs_under_torchrun(tmp_path):
    """examples/ddp_train.py on 2 gloo ranks: it trains (accuracy) and spends a plausible
    epsilon for sigma 1, q 0.05, 60 steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLES / "ddp_train.py"),
    ]
    for _ in range(3):
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
        )
        # torch 2.13's gloo occasionally aborts a rank at interpreter exit, after the
        # script finished ("terminate called without an active exception", about 1 run in
        # 15 here, not dpkern code): run again, in that case only (up to 3 runs)
        if proc.returncode == 0 or "terminate called" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    eps, acc = (float(v.split(",")[0]) for v in proc.stdout.split("= ")[1:3])
    assert 2.0 < eps < 5.0 and acc > 0.8, proc.stdout


def test_every_example_has_a_test():
    tested = {"ddp_train.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested
