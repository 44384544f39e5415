"""The documentation stays true: README.md and docs/ name only flags the parser accepts (or that the pages mark
as ignored or refused), only repository files that exist, only links and anchors that resolve; the README stays
short; the flag reference equals what the parser generates.  Pure Python: no ranks, no subprocesses."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from megalm.config import megatron_compat
from megalm.config.cli import build_parser
from megalm.config.flag_reference import COMMAND, PAGE, render

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))

# Flags of programs megalm does not own, named in the pages' commands.
EXTERNAL_FLAGS = {
    # torchrun
    "--nproc_per_node",
    "--nproc-per-node",
    "--nnodes",
    "--node_rank",
    "--node-rank",
    "--master_addr",
    "--master_port",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-id",
    "--rdzv_id",
    "--rdzv-conf",
    "--max-restarts",
    "--max_restarts",
    "--standalone",
    "--local-addr",
    # sbatch / srun
    "--nodes",
    "--signal",
    "--time",
    "--partition",
    "--ntasks-per-node",
    "--gpus-per-node",
    "--cpu-bind",
    "--kill-on-bad-exit",
    "--export",
    # tensorboard, mkdocs, pip, pytest, nsys
    "--logdir",
    "--strict",
    "--site-dir",
    "--durations",
    "--capture-range",
}
# Megatron-LM flags megalm does not have, named only to describe Megatron-LM's files or behaviour: the block naming
# one must say "Megatron".
MEGATRON_ONLY = {
    "--dist-ckpt-optim-fully-reshardable",  # the optimizer format the importer reads
    "--exit-signal",  # a saved arg the importer unpickles
    "--moe-apply-probs-on-input",  # refused by the importer
    "--cpu-offloading-activations",  # megalm offloads activations only
}
# Words that say a flag is ignored or refused, looked for in the block (paragraph, list item, table row) naming it.
MARKERS = ("no effect", "refused", "refuse", "not built", "not supported", "ignored", "changes nothing", "no-op")
CODE_FILE = re.compile(r"\.(py|sh|sbatch|md|json|yml|yaml|toml|svg|png)$")
REPO_DIRS = ("megalm/", "tools/", "scripts/", "examples/", "bench/", "tests/", "docs/", ".ci/")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*(?![-*\w])")  # not a glob such as --no-*-fusion
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (where links are not links)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set:
    """The anchors of a page's headings, duplicates numbered as the toc extension numbers them."""
    seen, out = {}, set()
    for line in FENCE.sub("", _text(page)).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        s = base if base not in seen else f"{base}_{seen[base]}"
        seen[base] = seen.get(base, 0) + 1
        out.add(s)
    return out


def _parser_flags() -> dict:
    """Flag -> help text, every option string of pretrain_gpt.py's parser."""
    out = {}
    for action in build_parser()._actions:
        for s in action.option_strings:
            out[s] = action.help or ""
    return out


def _repo_flags() -> set:
    """Flags the repository's own tools define or pass (quoted in Python sources, written in shell scripts)."""
    out = set()
    for path in list(REPO.glob("tools/**/*.py")) + list(REPO.glob("bench/*.py")) + list(REPO.glob("examples/*")):
        out.update(re.findall(r"""["'](--[a-z][a-z0-9_-]*)["']""", path.read_text(encoding="utf-8")))
    for path in (
        list(REPO.glob("scripts/**/*.sh")) + list(REPO.glob("scripts/**/*.sbatch")) + list(REPO.glob("bench/*.sh"))
    ):
        out.update(FLAG.findall(path.read_text(encoding="utf-8")))
    return out


def _blocks(text: str):
    """Paragraphs, list items and table rows: the unit a flag's note must share with the flag."""
    for para in re.split(r"\n\s*\n", text):
        lines = para.splitlines()
        if any(ln.lstrip().startswith("|") for ln in lines):
            yield from lines
        else:
            yield para


def test_every_flag_is_accepted_or_marked():
    parser_flags = _parser_flags()
    repo_flags = _repo_flags()
    # Megatron-LM flags megalm accepts but ignores or refuses (megatron_compat's lists, as the parser documents them).
    marked = {
        f
        for f in set(megatron_compat.NO_EFFECT) | set(megatron_compat.UNSUPPORTED)
        if parser_flags.get(f, "").lower().startswith(("no effect", "refused"))
    }
    unknown, unmarked = [], []
    for page in PAGES:
        if page.parts[-2:] == ("reference", "flags.md"):
            continue  # generated from the parser itself
        text = _text(page)
        for flag in sorted(set(FLAG.findall(text))):
            if flag not in set(parser_flags) | repo_flags | EXTERNAL_FLAGS | MEGATRON_ONLY:
                unknown.append(f"{_rel(page)}: {flag}")
        for block in _blocks(text):
            for flag in set(FLAG.findall(block)) & MEGATRON_ONLY:
                if "megatron" not in block.lower():
                    unmarked.append(f"{_rel(page)}: {flag} in {block[:80]!r}")
            for flag in set(FLAG.findall(block)) & marked:
                if not any(m in block.lower() for m in MARKERS):
                    unmarked.append(f"{_rel(page)}: {flag} in {block[:80]!r}")
    assert not unknown, "flags no parser accepts (fix the page or the flag): " + "; ".join(unknown)
    assert not unmarked, "ignored/refused Megatron-LM flags named without saying so: " + "; ".join(unmarked)


def test_commands_name_files_that_exist():
    missing = []
    for page in PAGES:
        for block in FENCE.findall(_text(page)):
            for token in re.findall(r"[\w./{}*-]+", block):
                token = token.rstrip(".")
                if any(c in token for c in "{}*") or token.startswith(("/", "http")):
                    continue
                if not (token.startswith(REPO_DIRS) or ("/" not in token and CODE_FILE.search(token))):
                    continue
                if "/" not in token and not (REPO / token).exists():
                    continue  # a bare file name: an output or an input of the user's (corpus.jsonl, tok.model)
                if not (REPO / token).exists():
                    missing.append(f"{_rel(page)}: {token}")
    assert not missing, "commands name repository files that do not exist: " + "; ".join(missing)


def test_links_and_anchors_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(_text(page))):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{_rel(page)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{_rel(page)}: {target} (no heading with that anchor)")
    assert not broken, "; ".join(broken)


def test_slug_matches_mkdocs():
    assert slug("Hierarchical reduction (multi-node)") == "hierarchical-reduction-multi-node"
    assert slug("Memory: sharding strategies") == "memory-sharding-strategies"
    assert slug("`--foo` and the bar") == "-foo-and-the-bar"
    assert slug("megatron_compat") == "megatron_compat"


def test_readme_is_short_and_keeps_its_commands():
    readme = _text(REPO / "README.md")
    assert len(readme.splitlines()) < 200, "README.md must stay under 200 lines: move detail to docs/"
    test_command = "bash tools/install.sh && python3 -m pytest -q tests"
    assert readme.splitlines()[3].startswith("bash examples/quickstart.sh ")
    assert readme.splitlines()[4].startswith(test_command + " ")
    assert test_command in _text(REPO / ".ci" / "run").splitlines(), "CI must run the README's test command"


def test_pages_open_with_a_command():
    for page in sorted((REPO / "docs").rglob("*.md")):
        lines = [ln for ln in _text(page).splitlines() if ln.strip()]
        opening = [ln.startswith("```") for ln in lines[1:6]]
        assert lines[0].startswith("# ") and any(opening), f"{_rel(page)} must open with a command (a code block)"


def test_flag_reference_is_current():
    current = (REPO / PAGE).read_text(encoding="utf-8") if (REPO / PAGE).exists() else ""
    assert current == render(), f"{PAGE} is out of date: run `{COMMAND}` and commit it"


@pytest.mark.parametrize("bad", ["[x](no_such_page.md)", "[x](index.md#no-such-heading)"])
def test_link_check_catches(tmp_path, monkeypatch, bad):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n```bash\nls\n```\n\n## Real heading\n")
    page = docs / "page.md"
    page.write_text(f"# Page\n\n```bash\nls\n```\n\n{bad} and [ok](index.md#real-heading)\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "PAGES", [page])
    with pytest.raises(AssertionError, match=re.escape(bad[4:-1])):
        test_links_and_anchors_resolve()
