"""README.md runs as written: every shell command and every Python block in it, in order.

A README block is `sh` (commands, run), `python` (run in this process, each on its own unless
its first line is `# continues the block above`) or `text` (output and listings, not run). A
block that cannot run here carries `<!-- not run: NAME -->` on the line above it, and NAME must
be one of `NOT_RUN` below, so that skipping a new block takes a change here too. Commands run
shortened, as the README says under "This README is tested": configs at their `:tiny` size, at
most 8 steps, `/tmp/...` inside a scratch folder. Everything runs in one scratch folder (with
`configs/`, `examples/` and `scripts/` linked in), so a block may use what an earlier one made:
the export snippet reads the export that the command before it wrote.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, fake_cpu_env

README = ROOT / "README.md"

NOT_RUN = {
    "make-targets": "they create .venv and run this test suite",
    "cluster": "a Slurm allocation and a Cloud TPU slice",
    "benchmarks": "the full benchmark takes about 16 minutes on this CPU",
    "gpu-benchmarks": "they are sized for a GPU",
    "plan": "they need the extra mptrain[plan]; tests/plan_test.py runs them under make test-plan",
}
MAX_STEPS = 8
CONTINUES = "# continues the block above"  # a Python block's first line: it runs on its names
_NOT_RUN_MARK = re.compile(r"^<!-- not run: ([\w-]+) -->$")


@dataclasses.dataclass
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None  # the NAME of a `<!-- not run: NAME -->` mark

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.lang})"


def readme_blocks(text: str) -> list[Block]:
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = _NOT_RUN_MARK.match(lines[start - 1].strip()) if start else None
            body = "\n".join(lines[start + 1 : end]) + "\n"
            found.append(Block(start + 1, lang, body, mark and mark.group(1)))
            i = end
        i += 1
    return found


def commands(block: Block) -> list[list[str]]:
    """The commands of an `sh` block: continuation lines joined, comments dropped."""
    joined = block.text.replace("\\\n", " ")
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def shortened(words: list[str], scratch: Path) -> list[str]:
    """A README command as this test runs it (see the module doc)."""
    words = [re.sub(r"(^|=)/tmp/", rf"\g<1>{scratch}/tmp/", w) for w in words]
    if words[:1] == ["python"]:
        words[0] = sys.executable
    if words[1:3] != ["-m", "mptrain.main"]:
        return words
    out = []
    for w in words:
        if w.startswith("--config=") and ":" not in w:
            w += ":tiny"
        elif w.startswith("--config.num_train_steps="):
            w = f"--config.num_train_steps={min(int(w.split('=')[1]), MAX_STEPS)}"
        out.append(w)
    return out


def _expand(words: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in words]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_command(words: list[str], scratch: Path) -> None:
    env = fake_cpu_env(1)
    if any("$PROCESS_ID" in w for w in words):  # the no-scheduler command: one per host
        env = fake_cpu_env(2)
        env |= {"COORDINATOR": f"localhost:{_free_port()}", "RUNS": str(scratch / "shared")}
        procs = [
            subprocess.Popen(
                _expand(words, env | {"PROCESS_ID": str(i)}),
                cwd=scratch,
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        errs = [p.communicate(timeout=300)[1] for p in procs]
        for p, err in zip(procs, errs, strict=True):
            assert p.returncode == 0, f"{shlex.join(words)}\n{err[-3000:]}"
        assert "mesh 4 devices: data 4 x fsdp 1" in errs[0], errs[0][-3000:]
        return
    done = subprocess.run(words, cwd=scratch, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout[-1500:]}{done.stderr[-3000:]}"


def test_every_block_says_what_it_is_and_every_skip_is_known():
    blocks = readme_blocks(README.read_text())
    assert len(blocks) > 10
    assert not [str(b) for b in blocks if b.lang not in ("sh", "python", "text")]
    marked = {b.not_run for b in blocks if b.not_run}
    assert marked == set(NOT_RUN), (marked, set(NOT_RUN))


def test_the_shortening_is_the_documented_one(tmp_path):
    text = README.read_text()
    assert ":tiny" in text and f"at most {MAX_STEPS} steps" in text
    words = shlex.split("python -m mptrain.main --config=configs/default.py --workdir=/tmp/t")
    words += ["--config.num_train_steps=200"]
    assert shortened(words, tmp_path)[1:] == [
        "-m",
        "mptrain.main",
        "--config=configs/default.py:tiny",
        f"--workdir={tmp_path}/tmp/t",
        f"--config.num_train_steps={MAX_STEPS}",
    ]


def test_every_command_and_snippet_of_the_readme_runs(tmp_path, monkeypatch):
    scratch = tmp_path / "readme"
    (scratch / "tmp").mkdir(parents=True)
    for name in ("configs", "examples", "scripts"):
        (scratch / name).symlink_to(ROOT / name)
    monkeypatch.chdir(scratch)
    monkeypatch.syspath_prepend(str(scratch))
    ran = set()
    for block in readme_blocks(README.read_text()):
        if block.not_run or block.lang == "text":
            continue
        if block.lang == "python":
            if not block.text.startswith(CONTINUES):  # else: the names of the block before
                namespace = {"__name__": f"readme_{block.line}"}
            exec(compile(block.text, str(block), "exec"), namespace)
            continue
        for words in commands(block):
            words = shortened(words, scratch)
            key = shlex.join(w for w in words if not w.startswith("--workdir="))
            if key not in ran:  # the same command at :tiny, only in another workdir
                ran.add(key)
                run_command(words, scratch)
    assert len(ran) >= 5
