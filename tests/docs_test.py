"""README.md and every page of docs/ run as written: each command and Python block, page by page.

How a page is read (docs/design.md, "The docs are tested", says the same for writers): a block
is `sh` (commands, run), `python` (run in this process, each on its own unless its first line is
`# continues the block above`) or `text` (output and listings, not run). A comment on the line
above a block says more: `<!-- file: PATH -->` (the reader writes the block, `python` or
`json`, as PATH; so does the test), `<!-- ctrl-c -->` (the reader stops the command with
Ctrl-C: SIGINT once it prints its first progress line, then exit code 75 is required) and
`<!-- not run: NAME -->` (skipped, and NAME must be one of `NOT_RUN` below, so that skipping a
new block takes a change here too).
Commands run shortened: a config of this repository at its `:tiny` size, at most 8 steps; a
config the page writes, 2,000 steps (what getting-started.md prints holds by then); `/tmp/...`
inside the page's scratch folder. Each page runs in a scratch folder of its own (with
`configs/`, `examples/` and `scripts/` linked in), so a block may use what an earlier block of
the same page made. `run_page` also drives tests/getting_started_test.py, from a fresh venv.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, fake_cpu_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
NOT_RUN = {
    "make-targets": "they create .venv and run this test suite",
    "install": "a fresh venv: tests/getting_started_test.py makes one (make test-slow)",
    "cluster": "a Slurm allocation and a Cloud TPU slice",
    "benchmarks": "the full benchmark takes about 16 minutes on this CPU",
    "gpu-benchmarks": "they are sized for a GPU",
    "plan": "they need the extra mptrain[plan]; make test-plan runs tests/plan/plan_test.py",
    "download": "a gated checkpoint of gigabytes from the Hugging Face Hub",
    "sft-tiny": "400 steps; make test-slow's tests/data/sft_train_test.py runs it cut to 60",
    "dpo-tiny": "tests/train/dpo_train_test.py runs 24 of its steps in two precisions (slow)",
    "grpo-folder": "a model folder of the reader's; the page's runs are grpo_tiny's",
    "grpo-lora": "tests/train/grpo_train_test.py runs it for 30 steps (slow)",
    "bucket": "a bucket of the reader's; tests/train/bucket_workdir_test.py runs against local "
    "S3 and GCS servers",
}
MAX_STEPS = 8
PAGE_STEPS = 2_000  # a config the page writes (README's and getting-started's: 20,000)
FILE_LANGS = ("python", "json")  # what a `file` block may be: a script, a config, a jsonl
CONTINUES = "# continues the block above"  # a Python block's first line: it runs on its names
REPO_DIRS = ("configs", "examples", "scripts")  # linked into each scratch folder
_MARK = re.compile(r"^<!-- (not run|file|ctrl-c)(?:: ([\w./-]+))? -->$")
_PROGRESS = re.compile(r"\((\d+)/\d+\)")  # the progress line's "(500/20000)"


@dataclasses.dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str | None = None  # "not run", "file" or "ctrl-c"
    arg: str | None = None  # the NAME of a not-run mark, the PATH of a file mark

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"


def page_blocks(page: Path) -> list[Block]:
    lines, found, i = page.read_text().splitlines(), [], 0
    name = str(page.relative_to(ROOT))
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = _MARK.match(lines[start - 1].strip()) if start else None
            body = "\n".join(lines[start + 1 : end]) + "\n"
            found.append(Block(name, start + 1, lang, body, *(mark.groups() if mark else ())))
            i = end
        i += 1
    return found


def commands(block: Block) -> list[list[str]]:
    """The commands of an `sh` block: continuation lines joined, comments dropped."""
    joined = block.text.replace("\\\n", " ")
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def shortened(words: list[str], scratch: Path, python: str = sys.executable) -> list[str]:
    """A documented command as this test runs it (see the module doc)."""
    words = [re.sub(r"(^|=)/tmp/", rf"\g<1>{scratch}/tmp/", w) for w in words]
    if words[:1] == ["python"]:
        words[0] = python
    if words[1:3] != ["-m", "mptrain.main"]:
        return words
    out, capped = [], False
    for w in words:
        if w.startswith("--config=") and ":" not in w and w[9:].startswith(REPO_DIRS):
            w += ":tiny"
        elif w.startswith("--config.num_train_steps="):
            w, capped = f"--config.num_train_steps={min(int(w.split('=')[1]), MAX_STEPS)}", True
        out.append(w)
    ours = any(w.startswith("--config=") and w[9:].startswith(REPO_DIRS) for w in words)
    steps = MAX_STEPS if ours else PAGE_STEPS
    return out if capped else [*out, f"--config.num_train_steps={steps}"]


def _expand(words: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in words]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_on_two_hosts(words: list[str], scratch: Path) -> None:
    """The no-scheduler multi-host command: one process per 'host', 2 CPU devices each."""
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
    assert "mesh 4 devices: data 4 x fsdp 1 x expert 1 x context 1" in errs[0], errs[0][-3000:]


def _run_interrupted(words: list[str], scratch: Path, env: dict[str, str]) -> None:
    """What a reader's Ctrl-C does: SIGINT once training is under way; a checkpoint, exit 75."""
    proc = subprocess.Popen(
        words, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if (m := _PROGRESS.search(line)) and int(m.group(1)) > 0:
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=300)
    err = "".join(seen) + err
    assert proc.returncode == 75, f"{shlex.join(words)}: exit {proc.returncode}\n{err[-3000:]}"
    assert "checkpoint written, run the same command again to resume" in out + err


def run_command(words: list[str], scratch: Path, env: dict[str, str], ctrl_c: bool) -> str:
    if any("$PROCESS_ID" in w for w in words):
        _run_on_two_hosts(words, scratch)
        return ""
    if ctrl_c:
        _run_interrupted(words, scratch, env)
        return ""
    done = subprocess.run(words, cwd=scratch, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout[-1500:]}{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def run_page(
    page: Path,
    scratch: Path,
    *,
    python: str | None = None,
    env: dict[str, str] | None = None,
    link_repo: bool = True,
) -> dict[str, str]:
    """Runs `page`'s blocks in order in `scratch`. Python blocks run in this process, or with
    `python` (a venv's interpreter) as a script each. Returns each command run (the key it was
    run under) with its output."""
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    for name in REPO_DIRS if link_repo else ():
        if not (scratch / name).exists():
            (scratch / name).symlink_to(ROOT / name)
    env = env if env is not None else fake_cpu_env(1)
    ran: dict[str, str] = {}
    namespace: dict = {}
    for block in page_blocks(page):
        if block.mark == "file":
            (scratch / block.arg).parent.mkdir(parents=True, exist_ok=True)
            (scratch / block.arg).write_text(block.text)
            continue
        if block.mark == "not run" or block.lang == "text":
            continue
        if block.lang == "python":
            if python is not None:
                script = scratch / f"block_{block.line}.py"
                script.write_text(block.text)
                run_command([python, str(script)], scratch, env, ctrl_c=False)
                continue
            if not block.text.startswith(CONTINUES):  # else: the names of the block before
                namespace = {"__name__": f"docs_{block.line}"}
            exec(compile(block.text, str(block), "exec"), namespace)
            continue
        for words in commands(block):
            words = shortened(words, scratch, python or sys.executable)
            key = shlex.join(w for w in words if not w.startswith("--workdir="))
            if key in ran:  # the same command at :tiny, only in another workdir
                continue
            output = run_command(words, scratch, env, ctrl_c=block.mark == "ctrl-c")
            if block.mark != "ctrl-c":  # the same command, run again, resumes
                ran[key] = output
    return ran


def hidden_tensorflow(folder: Path) -> dict[str, str]:
    """An environment in which `import tensorflow` (or tensorflow_datasets) fails, as where it
    is not installed: the getting-started path must not need it."""
    for name in ("tensorflow", "tensorflow_datasets"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} is hidden')\n")
    env = fake_cpu_env(1)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_says_what_it_is_and_every_skip_is_known(page):
    blocks = page_blocks(page)
    langs = ("sh", "python", "text")
    assert not [str(b) for b in blocks if b.lang not in langs and b.mark != "file"]
    assert not [str(b) for b in blocks if b.mark == "not run" and b.arg not in NOT_RUN]
    assert not [str(b) for b in blocks if b.mark == "file" and b.lang not in FILE_LANGS]
    assert not [str(b) for b in blocks if b.mark == "ctrl-c" and len(commands(b)) != 1]


def test_every_skip_named_is_used_and_the_pages_have_blocks():
    blocks = [b for page in PAGES for b in page_blocks(page)]
    assert {b.arg for b in blocks if b.mark == "not run"} == set(NOT_RUN)
    assert len(blocks) > 40


def test_the_shortening_is_the_documented_one(tmp_path):
    text = (ROOT / "docs" / "design.md").read_text()
    assert ":tiny" in text and f"at most {MAX_STEPS} steps" in text
    assert f"a config the page writes, {PAGE_STEPS:,} steps" in text
    words = shlex.split("python -m mptrain.main --config=configs/default.py --workdir=/tmp/t")
    words += ["--config.num_train_steps=200"]
    assert shortened(words, tmp_path)[1:] == [
        "-m",
        "mptrain.main",
        "--config=configs/default.py:tiny",
        f"--workdir={tmp_path}/tmp/t",
        f"--config.num_train_steps={MAX_STEPS}",
    ]
    sized = ["python", "-m", "mptrain.main", "--config=configs/llama3.py:moe_tiny"]
    assert shortened(sized, tmp_path)[3:] == [*sized[3:], f"--config.num_train_steps={MAX_STEPS}"]
    own = ["python", "-m", "mptrain.main", "--config=config.py", "--workdir=runs/x"]
    assert shortened(own, tmp_path)[3:] == [*own[3:], f"--config.num_train_steps={PAGE_STEPS}"]


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to
    hyphens (code blocks are not headings)."""
    found, code = set(), False
    for line in page.read_text().splitlines():
        code ^= line.startswith("```")
        if not code and (m := re.match(r"#+ (.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            found.add(slug)
    return found


def broken_links(page: Path) -> list[str]:
    bad, code = [], False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        code ^= line.startswith("```")
        for target in [] if code else _LINK.findall(line):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                bad.append(f"{page.name}:{n}: {target}: no such file")
            elif anchor and (where.suffix != ".md" or anchor not in anchors(where)):
                bad.append(f"{page.name}:{n}: {target}: no heading #{anchor}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_leads_somewhere(page):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[ok](#a-page) [gone](missing.md) [no](#nowhere)\n")
    assert [bad.split(": ", 1)[1] for bad in broken_links(page)] == [
        "missing.md: no such file",
        "#nowhere: no heading #nowhere",
    ]


def test_the_readme_leads_to_every_page_of_the_guide():
    linked = set(re.findall(r"\(docs/([\w-]+\.md)", (ROOT / "README.md").read_text()))
    assert linked == {p.name for p in PAGES[1:]}


def unnamed_scripts(root: Path = ROOT) -> list[str]:
    """The files of `scripts/` that no page names as `scripts/NAME`."""
    text = "".join(page.read_text() for page in PAGES)
    files = [p.name for p in (root / "scripts").iterdir() if p.is_file()]  # not __pycache__/
    return sorted(name for name in files if f"scripts/{name}" not in text)


def test_every_script_is_named_on_a_page():
    """scripts/ is for users: a script there is one a page sends its reader to. A fixture maker
    lives beside its fixtures, a probe behind one figure beside the page (docs/measured/)."""
    assert unnamed_scripts() == []


def test_an_unnamed_script_is_found(tmp_path):
    (tmp_path / "scripts" / "__pycache__").mkdir(parents=True)
    for name in ("bench.py", "orphan.py"):
        (tmp_path / "scripts" / name).write_text("")
    assert unnamed_scripts(tmp_path) == ["orphan.py"]


def test_the_readmes_own_model_is_the_getting_started_pages():
    """The README shows the same two files as the guide's first page: one to keep right."""

    def files(page):
        return {b.arg: b.text for b in page_blocks(page) if b.mark == "file"}

    readme = files(ROOT / "README.md")
    assert readme and readme.items() <= files(GETTING_STARTED).items()


# The pages whose commands train (each run twice: the second resumes; 5-50 s a page on a fresh
# machine) run in make test-slow; the rest run in make test. getting-started.md runs in make
# test-slow twice: here, and from a fresh venv (getting_started_test.py).
SLOW_PAGES = (
    "README.md",
    "faults.md",
    "performance.md",
    "trainer.md",
    "models-and-data.md",
    "precision.md",
    "multi-host.md",
    "loss-scaling.md",
    "getting-started.md",
    "fine-tuning.md",
    "sft.md",
    "dpo.md",
    "rl.md",
    "mixture-of-experts.md",
    "fp8.md",
    "export.md",
)


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p for p in PAGES],
    ids=lambda p: p.name,
)
def test_every_command_and_snippet_of_the_page_runs(page, tmp_path, monkeypatch):
    scratch = tmp_path / "page"
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    monkeypatch.syspath_prepend(str(scratch))
    env = hidden_tensorflow(tmp_path / "hidden") if page == GETTING_STARTED else None
    ran = run_page(page, scratch, env=env)
    runnable = [b for b in page_blocks(page) if b.lang == "sh" and b.mark != "not run"]
    assert bool(ran) == bool(runnable)
    if page == GETTING_STARTED:
        assert_the_path_went_as_the_page_says(ran)


def assert_the_path_went_as_the_page_says(ran: dict[str, str]) -> None:
    """After the Ctrl-C (which `run_page` checks), the same command resumed, and the exported
    fp16 weights classify the four points as the page prints."""
    output = "\n".join(ran.values())
    assert "mptrain: resuming from step " in output
    assert "skipped steps " in output and "precision fp16-mixed" in output
    assert "float16 [1 1 0 0]" in output
