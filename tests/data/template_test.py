"""A chat template is user input (issue 55): a render that loops without end, or makes more
than it should, stops within its bounds with one line naming the template and the bound, and
the command line exits 2 within seconds and a bounded memory. No compiles."""

import json
import subprocess
import sys
import time

import pytest
from helpers import ROOT

from mptrain.data import template

SMALL = 10_000  # the bound on characters in these tests
GROWING = {  # what each operation is asked to make: past SMALL characters, or hours of work
    "*": "{{ 'x' * 1000000000 }}",
    "~ doubling": "{% set n = namespace(s='ab') %}{% for i in range(60) %}"
    "{% set n.s = n.s ~ n.s %}{% endfor %}",
    "+ doubling": "{% set n = namespace(s='ab') %}{% for i in range(60) %}"
    "{% set n.s = n.s + n.s %}{% endfor %}",
    "**": "{{ 10 ** 1000000000 }}",
    "% width": "{{ '%1000000000d' % 1 }}",
    "format width": "{{ '{:>1000000000}'.format(1) }}",
    "center": "{{ 'x'.center(1000000000) }}",
    "center filter": "{{ 'x' | center(1000000000) }}",
    "join": "{{ (['x' * 5000] * 1000000) | join }}",
    "str.join": "{{ ''.join(['x' * 5000] * 100000) }}",
    "replace": "{{ ('a' * 5000).replace('a', 'b' * 5000) }}",
    "indent": "{{ ('\n' * 5000) | indent(5000) }}",
    "expandtabs": "{{ ('\t' * 5000).expandtabs(5000) }}",
    "batch fill": "{{ [1] | batch(1000000000, 0) | list }}",
    "the text": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "a macro's text": "{% macro m() %}{% for i in range(100000) %}x{% endfor %}{% endmacro %}"
    "{% set y = m() %}",
}


@pytest.mark.parametrize("text", GROWING.values(), ids=GROWING.keys())
def test_what_a_template_makes_is_held_to_its_bound_before_it_is_made(text):
    bounded = template.Template(text, "the test's template", max_chars=SMALL)
    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        template.render(bounded, messages=[])
    assert time.perf_counter() - start < 1.0  # refused, not made and measured
    assert str(e.value).startswith("the chat template (the test's template) ")
    assert str(e.value).endswith("past data.template_max_chars=10,000"), str(e.value)


def test_a_render_past_its_time_stops_and_says_so_on_any_thread():
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    bounded = template.Template(loops, "loops", max_seconds=0.3)
    found = []

    def run():
        start = time.perf_counter()
        with pytest.raises(ValueError, match=r"^the chat template \(loops\) ran past data\.te"):
            template.render(bounded)
        found.append(time.perf_counter() - start)

    run()  # the main thread: a timer signal
    import threading

    thread = threading.Thread(target=run)  # another thread: the clock, looked at every line
    thread.start()
    thread.join()
    assert len(found) == 2 and all(0.3 <= s < 2.0 for s in found), found


def test_a_templates_own_errors_name_it_and_ordinary_templates_render_as_jinja_does():
    for text, says in [
        ("{{ 1 / 0 }}", "does not render it: ZeroDivisionError: division by zero"),
        ("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "recursed past Python's limit"),
        ("{{ lipsum(5) }}", "does not render it: 'lipsum' is undefined"),
        ("{{ x | nosuchfilter }}", "does not render it: No filter named 'nosuchfilter'"),
        ("{{ messages | tojson(indent=100) }}", "asked tojson for an indent of 100, past 16"),
    ]:
        with pytest.raises(ValueError) as e:
            template.render(template.Template(text, "t"), messages=[])
        assert str(e.value).startswith("the chat template (t) ") and says in str(e.value)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = (
        "{% for m in messages %}{{ '<|' + m.role + '|>' ~ m.content | trim | center(9) }}"
        "{{ m | tojson }}{{ '%3d' % loop.index }}{{ ([m.role] * 2) | join(',') }}{% endfor %}"
    )
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "hello"}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    want = plain.from_string(text).render(messages=messages)
    assert template.render(template.Template(text), messages=messages) == want


# The sweep's two cases (S45, S46): a template whose loops would run 10^10 times, and one that
# builds a 300 MB text, given on the command line to an SFT run on a file of conversations.
RUNAWAY = {
    "loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "ran past data.template_max_seconds=2",
    ),
    "300 MB": (
        "{% for i in range(300) %}{{ 'x' * 1000000 }}{% endfor %}",
        "past data.template_max_chars=4,000,000",
    ),
}


# Starts a command and reports its peak resident memory on the last line of stderr. A process
# forked from this test's (large) one would count the parent's pages in its peak until its exec
# (Linux keeps the higher of the two): this small launcher forks it instead.
PEAK = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(child.pid, 0)
sys.stderr.write(f"peak {usage.ru_maxrss * 1024}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("case", RUNAWAY)
def test_a_runaway_template_on_the_command_line_exits_2_in_seconds_and_little_memory(
    tmp_path, case
):
    text, says = RUNAWAY[case]
    chats = tmp_path / "chats.jsonl"
    line = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    chats.write_text((json.dumps(line) + "\n") * 20)
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable, "-c", PEAK, sys.executable, "-m", "mptrain.main",
            "--config=configs/llama3.py:sft_tiny", f"--workdir={tmp_path / 'run'}",
            f"--config.data.files={chats}", f"--config.data.cache_dir={tmp_path / 'cache'}",
            f"--config.data.chat_template={text}",
        ],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seconds, lines = time.perf_counter() - start, done.stderr.strip().splitlines()
    peak, last = int(lines[-1].removeprefix("peak ")), lines[-2]
    assert done.returncode == 2, done.stderr[-2000:]
    assert last.startswith(f"mptrain: error: config.data.files: {chats} line 1: the chat template")
    assert says in last and seconds < 10 and peak < 2**30, (seconds, peak, last)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
