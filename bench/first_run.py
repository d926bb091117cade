"""What a new user sees: the README's planner commands in order, then a tour of realistic tasks, each command's exit
code, wall time and its answer's key line; then whether the answers agree with each other (issue 32, "Must show").

    python bench/first_run.py            # planner only (a few minutes on 2 cores)
    python bench/first_run.py --train    # also the README's CPU trainings (launch ... --cpu), minutes more

Every step runs ``python -m search`` (the ``aceso`` command of this checkout) in a temporary folder. The README's
commands are read from its first ```bash blocks (those before "Search, then train on CPU"; with ``--train`` every
block, as tests/distributed/test_readme.py runs them). The tour: Llama-3-70B on 64 H100s (drop-in), DeepSeek-V3 on
256 H100s and on GB200 NVL72 racks, Qwen3-30B-A3B on 8 H100s (heterogeneous), a Hugging Face import (Qwen2.5-7B's
config.json), and a user's launch script (the exported one, priced back by explain). Agreement checks: a searched
plan's time is what ``explain PLAN`` prices it at, and the exported script's configuration is priced by explain at
the plan's time. Exit 0 when every step exits 0 and every check holds; a table is printed and JSON written to
bench/results/first_run.json.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from search.io.argparser import AcesoParser  # noqa: E402
HF = ROOT / "tests" / "unit" / "data" / "hf"

TOUR = [
    ("70B dense on 64 H100 (drop-in)", "search --model llama3-70b --cluster 8x8-h100 --global-batch-size 512 "
     "--target megatron-lm --budget-evals 300 -o llama70b.json"),
    ("DeepSeek-V3 on 256 H100 (drop-in)", "search --model deepseek-v3 --cluster 32x8-h100 --global-batch-size 4096 "
     "--target megatron-lm --budget-evals 200 -o dsv3-h100.json"),
    ("DeepSeek-V3 on GB200 NVL72 racks (drop-in)", "search --model deepseek-v3 --cluster 64x4-gb200-nvl72 "
     "--global-batch-size 4096 --target megatron-lm --budget-evals 200 -o dsv3-gb200.json"),
    ("Qwen3-30B-A3B on 8 H100 (heterogeneous)", "search --model qwen3-30b-a3b --cluster 1x8-h100 "
     "--global-batch-size 256 --budget-evals 300 -o qwen30.json"),
    ("HF import: Qwen2.5-7B config.json", f"models --from-hf {HF / 'qwen2.5-7b' / 'config.json'} --seq-length 4096 "
     "-o qwen25.json"),
    ("search the imported model", "search --model qwen25.json --cluster 1x8-h100 --global-batch-size 256 "
     "--target megatron-lm --budget-evals 200 -o qwen25-plan.json"),
    ("a user's launch script: export", "export llama70b.json -o llama70b.sh"),
    ("a user's launch script: explain", "explain --megatron-args-file llama70b.sh --cluster 8x8-h100 "
     "--search-budget-evals 0 --json"),
]
_BLOCK = re.compile(r"(?:<!-- readme-test: skip \(([^)]*)\) -->[ \t]*\n)?([ \t]*)```bash\n(.*?)\n[ \t]*```", re.S)
_PRELUDE = 'aceso() { "$ACESO_PYTHON" -m search "$@"; }\npython() { "$ACESO_PYTHON" "$@"; }\nset -eo pipefail\n'


def readme_blocks(train: bool) -> list[str]:
    """The README's bash blocks in order (those it marks ``readme-test: skip`` left out), each as one step: the
    planner's only (before the CPU trainings), or with ``train`` every one."""
    text = (ROOT / "README.md").read_text()
    if not train:
        text = text.split("### Search, then train on CPU")[0]
    out = []
    for m in _BLOCK.finditer(text):
        indent = m.group(2)
        if m.group(1) is None:
            out.append("\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in m.group(3).splitlines()))
    return out


def run(code: str, cwd: Path) -> tuple[dict, Path]:
    """One step (a README block or a tour command) in bash, ``aceso`` / ``python`` being this checkout's; the step's
    result and the folder it ends in (a block may ``cd``)."""
    where = cwd / ".pwd"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "ACESO_PYTHON": sys.executable, "HOME": str(cwd)}
    t = time.perf_counter()
    r = subprocess.run(["bash", "-c", f"{_PRELUDE}cd {shlex.quote(str(cwd))}\n{code}\npwd > {where}\n"],
                       capture_output=True, text=True, env=env, timeout=1800, check=False)
    wall = time.perf_counter() - t
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip() and ": note:" not in ln]
    key = [ln for ln in lines if re.search(r"predicted iteration|^iteration [\d.]+ ms|valid plan|^wrote|"
                                           r"^heterogeneous plan|^Megatron-LM plan|^best |your Megatron-LM", ln)]
    commands = [ln.split("  #")[0].strip() for ln in code.splitlines() if ln.startswith(("aceso ", "python "))]
    end = Path(where.read_text().strip()) if r.returncode == 0 and where.is_file() else cwd
    if r.stdout.lstrip().startswith("{"):             # --json: its iteration time
        with contextlib.suppress(ValueError):
            key = [f"iteration_time_ms {json.loads(r.stdout)['iteration_time_ms']:.1f}"]
    return {"commands": commands or [code], "exit": r.returncode, "wall_s": round(wall, 2),
            "answer": [k.strip()[:120] for k in key[-3:]] or [ln[:120] for ln in lines[-2:]],
            "stdout": r.stdout, "stderr": r.stderr}, end


def plan_ms(path: Path) -> float:
    return json.loads(path.read_text())["predicted"]["iteration_time_ms"]


def checks(steps: list[dict], cwd: Path) -> list[tuple[str, bool, str]]:
    """Answers that must agree: each searched plan as explain prices it; the exported script as explain prices it."""
    out = []
    for name in ("llama70b", "dsv3-h100", "dsv3-gb200", "qwen30", "qwen25-plan"):
        p = cwd / f"{name}.json"
        if not p.is_file():
            out.append((f"{name}: plan written", False, "missing"))
            continue
        r, _ = run(f"aceso explain {name}.json --json", cwd)
        got = json.loads(r["stdout"])["iteration_time_ms"] if r["exit"] == 0 else float("nan")
        out.append((f"{name}: search = explain PLAN", abs(got - plan_ms(p)) < 1e-3, f"{plan_ms(p):.1f} / {got:.1f} ms"))
    explained = next((s for s in steps if s["commands"][0].startswith("aceso explain --megatron-args-file")), None)
    if explained is not None and explained["exit"] == 0 and (cwd / "llama70b.json").is_file():
        got = json.loads(explained["stdout"])["iteration_time_ms"]
        want = plan_ms(cwd / "llama70b.json")
        out.append(("llama70b: exported script = its plan", abs(got - want) < 1e-3 * want, f"{want:.1f} / {got:.1f} ms"))
    return out


def main() -> int:
    ap = AcesoParser(prog="bench/first_run.py", description=__doc__.splitlines()[0])
    ap.add_argument("--train", action="store_true", help="also run the README's CPU trainings")
    args = ap.parse_args()
    steps = []
    with tempfile.TemporaryDirectory() as d:
        cwd = top = Path(d)
        for code in readme_blocks(args.train):
            r, cwd = run(code, cwd)
            steps.append({"part": "README", **r})
        for what, cmd in TOUR:
            r, _ = run("aceso " + cmd, top)
            steps.append({"part": what, **r})
        agree = checks(steps, top)
    print(f"{'exit':>4} {'wall s':>7}  step: command(s), then what it answered")
    for s in steps:
        print(f"{s['exit']:>4} {s['wall_s']:>7.1f}  [{s['part']}] " + "\n              ".join(c[:110] for c in s["commands"]))
        shown = s["answer"] if s["exit"] == 0 else [(s["stderr"] or s["stdout"]).strip()[-300:]]
        for line in shown:
            print(f"{'':16}> {line}")
    print("\nanswers that must agree:")
    for name, ok, detail in agree:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    failed = [s for s in steps if s["exit"] != 0] + [a for a in agree if not a[1]]
    print(f"\n{len(steps)} commands, {sum(s['exit'] == 0 for s in steps)} exited 0, "
          f"{sum(a[1] for a in agree)}/{len(agree)} agreements, {sum(s['wall_s'] for s in steps):.0f} s")
    out = ROOT / "bench" / "results" / "first_run.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": [{k: v for k, v in s.items() if k not in ("stdout", "stderr")} for s in steps],
                               "agree": [{"check": n, "ok": o, "detail": x} for n, o, x in agree]}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
