"""`novarl validate` on real configs: wall time of the whole command, and whether torch was imported.

    .venv/bin/python benchmarks/bench_validate.py [--repeats 5] [--out benchmarks/results/validate_cpu.md]

Runs `novarl validate FILE` (a fresh process each time, with an empty Hugging Face cache:
HF_HOME a new temporary folder) on NeMo RL's GRPO configs and recipes in tests/data/nemo_rl
as written (their named datasets and hub models are then notes: `novarl train` downloads
them; validate touches no network) and on the ROLL-format config in tests/data/roll, and
reports the median and the worst wall time of `--repeats` runs, the exit code,
and the heavy modules the process imported (`-X importtime`). The target (issue 16):
under 1 s for a config whose model is not local, with no torch import. The bundled
recipe, whose model is local, is measured beside them: it also loads the tokenizer,
reads every data row and calls the reward once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from models import cpu_name  # noqa: E402 -- run from this folder or as a script

ROOT = Path(__file__).resolve().parent.parent
NEMO_RL = ROOT / "tests" / "data" / "nemo_rl"
HEAVY = ("torch", "transformers", "megatron", "vllm", "deepspeed", "ray")


def configs() -> list[tuple[str, list[str]]]:
    """(config, its extra overrides): NeMo RL's loadable GRPO files, the ROLL-format one, the bundled recipe."""
    found = [(str(p.relative_to(ROOT)), []) for p in sorted(NEMO_RL.rglob("*.yaml"))
             if not any(bad in p.name for bad in ("sglang", "fp8", "dapo"))]
    found.append(("tests/data/roll/tiny_grpo_fsdp2.yaml", []))
    found.append(("novarl/config/recipes/tiny_arith.yaml", []))
    return found


def run(config: str, extra: list[str], work: Path) -> tuple[float, int, list[str]]:
    code = (f"import sys; from novarl.cli import main; rc = main(['validate', {str(ROOT / config)!r}, *{extra!r}]); "
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules]); sys.exit(rc)")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("HF_")},
                               "HF_HOME": str(work / "hf_home")})
    seconds = time.perf_counter() - start
    heavy = next((line[len("HEAVY "):] for line in proc.stdout.splitlines() if line.startswith("HEAVY ")), "?")
    return seconds, proc.returncode, json.loads(heavy.replace("'", '"')) if heavy != "?" else ["?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "validate_cpu.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        (work / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                                                  for a in range(20)))
        (work / "data").mkdir()
        (work / "data" / "train.jsonl").write_text((work / "train.jsonl").read_text())
        for config, extra in configs():
            runs = [run(config, extra, work) for _ in range(args.repeats)]
            times = [t for t, _, _ in runs]
            rows.append((config, statistics.median(times), max(times), runs[0][1], runs[0][2]))
            print(f"{config}: median {rows[-1][1]:.2f} s, worst {rows[-1][2]:.2f} s, exit {rows[-1][3]}, "
                  f"heavy {rows[-1][4]}", flush=True)
    lines = [f"# `novarl validate` wall time ({date.today()}, {cpu_name()}, {os.cpu_count()} cores)", "",
             f"`{' '.join(['.venv/bin/python', 'benchmarks/bench_validate.py', f'--repeats {args.repeats}'])}`: "
             "a fresh `novarl validate` process per run, an empty Hugging Face cache, median and worst of "
             f"{args.repeats}. NeMo RL files as written: their named datasets and models are hub ids that are "
             "not cached (notes: `novarl train` downloads them), so only the torch-free checks run. "
             "Target (issue 16): under 1 s without a local model, no torch import.", "",
             "| config | median s | worst s | exit | heavy modules imported |", "|---|---:|---:|---:|---|"]
    for config, median, worst, code, heavy in rows:
        lines.append(f"| {config} | {median:.2f} | {worst:.2f} | {code} | {', '.join(heavy) or 'none'} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
