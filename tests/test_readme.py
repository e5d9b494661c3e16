"""The README as a user reads it: every Python block runs as pasted, every command parses, every
docs/ link resolves, and it stays short.

Python blocks run in order in one namespace (a later block uses what an earlier one made), in a
temporary folder. A block that cannot run here is marked on the line just above its fence with
``<!-- readme-test: skip (needs ...) -->``; the reason is required and must say what it needs.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 200
_DIRECTIVE = re.compile(r"<!--\s*readme-test:(.*?)-->")
_SKIP = re.compile(r"^\s*skip \((needs [^)]+)\)\s*$")


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason, for a block marked to be skipped


def blocks(text: str) -> list[Block]:
    """Fenced code blocks, each with the skip reason its preceding line gives."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = lines[i - 1] if i else ""
            directive = _DIRECTIVE.search(above)
            skip = None
            if directive:
                reason = _SKIP.match(directive.group(1))
                assert reason, f"README line {i}: unknown readme-test directive {above.strip()!r}; " \
                               "write <!-- readme-test: skip (needs ...) -->"
                skip = reason.group(1)
            found.append(Block(lines[i][3:].strip(), i + 1, "\n".join(lines[i + 1:end]), skip))
            i = end + 1
        else:
            i += 1
    return found


def test_every_directive_sits_on_a_block():
    lines = README.read_text().splitlines()
    for n, line in enumerate(lines):
        if _DIRECTIVE.search(line):
            assert n + 1 < len(lines) and lines[n + 1].startswith("```python"), \
                f"README line {n + 1}: a readme-test directive must sit just above a ```python fence"


def test_every_python_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    python = [b for b in blocks(README.read_text()) if b.lang == "python"]
    ran = [b for b in python if b.skip is None]
    assert len(ran) >= 6, "the README's Python examples should run here, not be skipped"
    namespace: dict[str, object] = {"__name__": "readme"}
    for block in ran:
        try:
            exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
        except Exception as e:
            pytest.fail(f"the README's python block at line {block.line} fails: {type(e).__name__}: {e}")
    assert (tmp_path / "split.dot").read_text().startswith("digraph")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_skipped_blocks_at_least_compile():
    for block in blocks(README.read_text()):
        if block.lang == "python" and block.skip is not None:
            compile(block.code, f"README.md:{block.line}", "exec")  # a syntax error is caught even so


# ------------------------------------------------------------------ commands
def _commands(block: Block) -> list[str]:
    """The block's command lines, comments dropped and ``\\`` continuations joined."""
    text = block.code.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in text.splitlines() if line.strip()]


def _two_commands() -> tuple[str, str]:
    text = README.read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    bash = [b for b in blocks(section) if b.lang == "bash"]
    assert len(bash) == 2, "Two commands: one block for the demo, one for the tests"
    (demo,), (tests,) = (_commands(b) for b in bash)
    return demo, tests


def test_the_two_commands_are_the_ones_ci_runs():
    demo, tests = _two_commands()
    code = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]
    assert code[-1] == tests, ".ci/run ends with the README's test command, character for character"
    pin = re.search(r"torch==(\S+) ", tests)
    assert pin, tests
    assert demo == f"python3 -m pip install torch=={pin.group(1)} && python3 -m pip install . && pipesplit demo"
    leg = (ROOT / ".ci" / "torch_leg.sh").read_text()
    assert re.search(r"^pipesplit demo\b", leg, re.M), "CI's torch legs run the demo the README shows"


def test_every_pipesplit_command_parses():
    from pipesplit.cli import build_parser

    lines = [c for b in blocks(README.read_text()) if b.lang == "bash" for c in _commands(b)]
    ours = [c for c in lines if c.startswith("pipesplit ")]
    assert len(ours) >= 4
    for command in ours:
        args = shlex.split(command)[1:]
        try:
            build_parser().parse_args(args)
        except SystemExit as e:
            assert e.code == 0 and args == ["--version"], f"the README's `{command}` does not parse"


def test_every_example_the_readme_runs_exists():
    lines = [c for b in blocks(README.read_text()) if b.lang == "bash" for c in _commands(b)]
    scripts = [word for c in lines if c.startswith("torchrun ") for word in shlex.split(c) if word.endswith(".py")]
    assert scripts
    for script in scripts:
        assert (ROOT / script).is_file(), script


# ------------------------------------------------------------------ links and length
def test_docs_links_resolve_and_every_page_is_linked():
    text = README.read_text()
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", text))
    assert linked, "the README links its docs/ pages"
    for link in sorted(linked):
        assert (ROOT / link).is_file(), f"README links {link}, which does not exist"
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_docs_pages_link_what_exists():
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if "://" not in link:
                assert (page.parent / link).resolve().exists(), f"{page.name} links {link}, which does not exist"


def test_the_readme_stays_short():
    n = len(README.read_text().splitlines())
    assert n < MAX_LINES, f"README.md has {n} lines; keep it under {MAX_LINES} and move detail to docs/"


# ------------------------------------------------------------------ compile's options, named everywhere
def _compile_options() -> list[str]:
    import inspect

    import pipesplit

    params = inspect.signature(pipesplit.compile).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def test_the_readme_names_every_compile_option_and_cost():
    from pipesplit.passes.plan.planner import BUILTIN_COSTS

    section = README.read_text().split("## Compile", 1)[1].split("\n## ", 1)[0]
    options = _compile_options()
    assert len(options) >= 20
    missing = [name for name in options if f"`{name}`" not in section and f"{name}=" not in section]
    assert not missing, f"the README's compile section does not name {missing}"
    assert not [c for c in BUILTIN_COSTS if f'`"{c}"`' not in section], sorted(BUILTIN_COSTS)


def test_compiles_docstring_names_every_option_and_cost():
    import pipesplit
    from pipesplit.passes.plan.planner import BUILTIN_COSTS

    doc = pipesplit.compile.__doc__ or ""
    missing = [name for name in _compile_options() if not re.search(rf"^\s+{name}:", doc, re.M)]
    assert not missing, f"compile's docstring has no entry for {missing}"
    cost_entry = re.search(r"^\s+cost:(.*?)^\s+devices:", doc, re.M | re.S)
    assert cost_entry
    assert not [c for c in BUILTIN_COSTS if f'``"{c}"``' not in cost_entry.group(1)], sorted(BUILTIN_COSTS)
