"""gcpatch's main job, made visible: two set-ups that are silently wrong with plain transformers,
run plainly and with GCPATCH=1 (no code change), then gcpatch's own explanation."""

import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(case: str, gcpatch_on: bool, record_dir: str) -> dict:
    env = {
        **os.environ,
        "GCPATCH": "1" if gcpatch_on else "0",
        "GCPATCH_RECORD": record_dir,
        "GCPATCH_LOG": "off",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "train.py"), case],
        env=env,
        capture_output=True,
        text=True,
        cwd=record_dir,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"demo: train.py {case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def grads(result: dict) -> str:
    error = (
        "some missing"
        if result["max_error"] == float("inf")
        else f"max err {result['max_error']:.3g}"
    )
    return f"{result['wrong']} of {result['total']} gradients wrong ({error})"


def main() -> None:
    print(f"transformers {metadata.version('transformers')}, torch {metadata.version('torch')}\n")
    with tempfile.TemporaryDirectory() as record_dir:
        rows = []
        plain, fixed = (
            run("frozen-embeds", False, record_dir),
            run("frozen-embeds", True, record_dir),
        )
        rows.append(
            ("partially frozen, use_reentrant=True, inputs_embeds", grads(plain), grads(fixed))
        )
        plain, fixed = run("eval-mode", False, record_dir), run("eval-mode", True, record_dir)
        rows.append(
            (
                "checkpointing enabled, model left in eval mode",
                f"saves {plain['saved_fraction']:.0%} of activations",
                f"saves {fixed['saved_fraction']:.0%} of activations",
            )
        )
        width = max(len(r[0]) for r in rows)
        print(f"{'set-up':<{width}}  {'plain transformers':<40}  with GCPATCH=1")
        for name, before, after in rows:
            print(f"{name:<{width}}  {before:<40}  {after}")
        print("\nWhat gcpatch did and why (gcpatch explain):\n")
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "gcpatch", "explain", record_dir], check=True)


if __name__ == "__main__":
    main()
