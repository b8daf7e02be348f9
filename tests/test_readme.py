"""README.md's "Using it" runs as written, right after ``make train``, so the README cannot go stale.

One module fixture plays ``make train`` at a tiny size (the default config, 20 steps) in a scratch directory laid out
like the repository (``configs/`` linked, the run in ``runs/shakespeare-char-cpu``, its shards in
``data_cache/shakespeare-char``); then every command of the section's bash blocks runs there, as written, with only
size overrides appended (:data:`TINY`: fewer steps, fewer new tokens), and every Python block too. A command that
stops working fails here with its output.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = Path(os.environ.get("JAXGPT_SHAKESPEARE", REPO.parent / "shared/data/tinyshakespeare.txt"))

# appended to a command of that module, so it runs at a tiny size (later overrides win in both CLIs)
TINY = {
    "jaxgpt.train": ["--max_steps=2", "--eval_interval=2", "--eval_steps=1", "--sample_num=1", "--sample_len=8",
                     "--checkpoint_interval=2"],
    "torch_ref.train": ["--max_steps=2", "--eval_interval=2", "--eval_steps=1", "--sample_num=1",
                        "--sample_len=8"],
    "jaxgpt.generate": ["--max-new-tokens", "16"],
}


def section(text: str, title: str) -> str:
    """The text of README's ``## title`` section up to its first subsection or the next section."""
    start = text.index(f"\n## {title}\n")
    rest = text[start + 1:]
    end = re.search(r"\n##+ ", rest[3:])
    return rest[: end.start() + 3] if end else rest


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    out, joined = [], block.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
        if line:
            out.append(line)
    return out


USING_IT = section((REPO / "README.md").read_text(), "Using it")
COMMANDS = [c for b in blocks(USING_IT, "bash") for c in commands(b)]
PYTHON = blocks(USING_IT, "python")


def test_the_section_is_there():
    assert len(COMMANDS) >= 8 and all(c.startswith("python -m ") for c in COMMANDS), COMMANDS
    assert PYTHON, "the section shows loading the --to-torch export"


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def after_make_train(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    (root / "configs").symlink_to(REPO / "configs")
    corpus = root / "corpus"
    corpus.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if SHAKESPEARE.is_file():  # else make train's own routes find the text (its cache, a download), as a user's would
        env["JAXGPT_SHAKESPEARE"] = str(SHAKESPEARE)
    for i in range(2):  # a corpus of the user's own (any text does)
        (corpus / f"part{i}.txt").write_text(((REPO / "README.md").read_text() + "\n") * (i + 2))
    make_train = [sys.executable, "-m", "jaxgpt.train", "--max_steps=20", "--eval_interval=10", "--eval_steps=2",
                  "--checkpoint_interval=10", "--sample_num=1", "--sample_len=8"]
    r = run(make_train, root, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (root / "runs/shakespeare-char-cpu/checkpoints").is_dir()
    return root, env


@pytest.mark.parametrize("command", COMMANDS)
def test_command_runs_as_written(after_make_train, command):
    root, env = after_make_train
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-m"], command
    module = argv[2]
    r = run([sys.executable, *argv[1:], *TINY.get(module, [])], root, env)
    assert r.returncode == 0, f"{command}\nexit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def test_python_blocks_run_as_written(after_make_train):
    root, env = after_make_train
    if not (root / "out/char.pt").is_file():  # the export command above, when this test runs alone
        argv = shlex.split(next(c for c in COMMANDS if "--to-torch" in c))
        assert run([sys.executable, *argv[1:]], root, env).returncode == 0
    for code in PYTHON:
        check = code + "\nprint(type(model).__module__, model.config.n_layer)\n"
        r = run([sys.executable, "-c", check], root, env)
        assert r.returncode == 0, f"{code}\n{r.stderr[-3000:]}"
        assert r.stdout.split()[-2:] == ["torch_ref.model", "4"], r.stdout
