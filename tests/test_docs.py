"""The documentation stays true: README.md and docs/ name only flags the parser accepts (or that the pages mark
as ignored or refused), only repository files that exist, only links and anchors that resolve; the README stays
short; the flag reference equals what the parser generates.  Pure Python: no ranks, no subprocesses."""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from pathlib import Path

import pytest

from megalm.config import megatron_compat
from megalm.config.cli import build_parser
from megalm.config.flag_reference import COMMAND, PAGE, render

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
FROM_MEGATRON = REPO / "docs" / "from-megatron.md"

# Flags of programs megalm does not own, named in the pages' commands.
EXTERNAL_FLAGS = set(
    # torchrun
    "--nproc_per_node --nproc-per-node --nnodes --node_rank --node-rank --master_addr --master_port --rdzv-backend"
    " --rdzv_backend --rdzv-endpoint --rdzv_endpoint --rdzv-id --rdzv_id --rdzv-conf --max-restarts --max_restarts"
    " --standalone --local-addr"
    # sbatch / srun
    " --nodes --signal --time --partition --ntasks-per-node --gpus-per-node --cpu-bind --kill-on-bad-exit --export"
    # tensorboard, mkdocs, pytest, nsys
    " --logdir --strict --site-dir --durations --capture-range"
    # pip download (wheels for the GPU machine)
    " --only-binary --platform --python-version --implementation --no-deps --no-index --target --dest"
    # torchft_lighthouse
    " --bind --min_replicas --join_timeout_ms --heartbeat_timeout_ms"
    # torchrun (one group per local job)
    " --master-port".split()
)
# Megatron-LM flags megalm does not have, named only to describe Megatron-LM's files or behaviour: the block naming
# one must say "Megatron".
MEGATRON_ONLY = {
    "--dist-ckpt-optim-fully-reshardable",  # the optimizer format the importer reads
    "--exit-signal",  # a saved arg the importer unpickles
    "--moe-apply-probs-on-input",  # refused by the importer
    "--cpu-offloading-activations",  # megalm offloads activations only
    "--tp-comm-overlap",  # Megatron-LM's TP communication overlap (Transformer Engine userbuffers), not built
}
# Words that say a flag is ignored or refused, looked for in the block (paragraph, list item, table row) naming it.
MARKERS = ("no effect", "refused", "refuse", "not built", "not supported", "ignored", "changes nothing", "no-op")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*(?![-*\w])")  # not a glob such as --no-*-fusion
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
COMMANDS = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.M | re.S)  # code blocks of commands
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
REPO_DIRS = ("megalm/", "tools/", "scripts/", "examples/", "bench/", "tests/", "docs/", ".ci/")
PROGRAM = re.compile(r"\.(py|sh|sbatch)$")  # a bare name with these endings is a repository file run by the command


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _rel(page: Path, repo: Path) -> str:
    return str(page.relative_to(repo))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (where links are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


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
        if m:
            base = slug(m.group(1))
            out.add(base if base not in seen else f"{base}_{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


def _parser_flags() -> dict:
    """Flag -> help text, every option string of pretrain_gpt.py's parser."""
    return {s: a.help or "" for a in build_parser()._actions for s in a.option_strings}


def _repo_flags(repo: Path) -> set:
    """Flags the repository's own tools define or pass (quoted in Python sources, written in shell scripts)."""
    out = set()
    tools = [*repo.glob("tools/**/*.py"), *repo.glob("megalm/cli/*.py"), *repo.glob("megalm/*/cli.py")]  # tools' code
    for path in [*tools, *repo.glob("bench/*.py"), *repo.glob("examples/*")]:
        out.update(re.findall(r"""["'](--[a-z][a-z0-9_-]*)["']""", path.read_text(encoding="utf-8")))
    for path in [*repo.glob("scripts/**/*.sh"), *repo.glob("scripts/**/*.sbatch"), *repo.glob("bench/*.sh")]:
        out.update(FLAG.findall(path.read_text(encoding="utf-8")))
    # megalm-plan's own flags are its options dataclass's fields (the model's are pretrain_gpt.py's parser)
    from megalm.planner.cli import PlanOptions

    out.update("--" + f.name.replace("_", "-") for f in dataclasses.fields(PlanOptions))
    return out


def _marked_flags(parser_flags: dict) -> set:
    """Megatron-LM flags megalm accepts but ignores or refuses (megatron_compat's lists, as the parser says)."""
    listed = set(megatron_compat.NO_EFFECT) | set(megatron_compat.UNSUPPORTED)
    return {f for f in listed if parser_flags.get(f, "").lower().startswith(("no effect", "refused"))}


def _blocks(text: str):
    """Paragraphs, list items and table rows: the unit a flag's note must share with the flag."""
    for para in re.split(r"\n\s*\n", text):
        lines = para.splitlines()
        if any(ln.lstrip().startswith("|") for ln in lines):
            yield from lines
        else:
            yield para


def flag_problems(pages, repo: Path) -> list:
    parser_flags = _parser_flags()
    known = set(parser_flags) | _repo_flags(repo) | EXTERNAL_FLAGS | MEGATRON_ONLY
    marked = _marked_flags(parser_flags)
    out = []
    for page in pages:
        if page.parts[-2:] == ("reference", "flags.md"):
            continue  # generated from the parser itself
        text = _text(page)
        out += [f"{_rel(page, repo)}: {f} is accepted by no parser" for f in sorted(set(FLAG.findall(text)) - known)]
        for block in _blocks(text):
            low = block.lower()
            for flag in sorted(set(FLAG.findall(block)) & MEGATRON_ONLY):
                if "megatron" not in low:
                    out.append(f"{_rel(page, repo)}: {flag} is Megatron-LM's, not megalm's: say so in {block[:60]!r}")
            for flag in sorted(set(FLAG.findall(block)) & marked):
                if not any(m in low for m in MARKERS):
                    out.append(f"{_rel(page, repo)}: {flag} is ignored or refused: say so in {block[:60]!r}")
    return out


def file_problems(pages, repo: Path) -> list:
    out = []
    for page in pages:
        for block in COMMANDS.findall(_text(page)):
            for token in re.findall(r"[\w./{}*<>-]+", block):
                token = token.rstrip(".")
                if any(c in token for c in "{}*<>") or token.startswith(("/", "http", "..")):
                    continue  # a pattern, a placeholder, an absolute or outside path
                if token.startswith(REPO_DIRS) or ("/" not in token and PROGRAM.search(token)):
                    if not (repo / token).exists():
                        out.append(f"{_rel(page, repo)}: {token} does not exist")
    return out


def link_problems(pages, repo: Path) -> list:
    out = []
    for page in pages:
        for target in LINK.findall(_prose(_text(page))):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                out.append(f"{_rel(page, repo)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{_rel(page, repo)}: {target} (no heading with that anchor)")
    return out


def test_every_flag_is_accepted_or_marked():
    problems = flag_problems(PAGES, REPO)
    assert not problems, "\n".join(problems)


def test_commands_name_files_that_exist():
    problems = file_problems(PAGES, REPO)
    assert not problems, "\n".join(problems)


def test_links_and_anchors_resolve():
    problems = link_problems(PAGES, REPO)
    assert not problems, "\n".join(problems)


def test_megatron_flags_table_follows_megatron_compat():
    """from-megatron.md's table names every flag megatron_compat ignores or refuses, and calls refused only
    flags that still are (a flag implemented since must leave the table's refused rows)."""
    text = _text(FROM_MEGATRON)
    rows = [ln for ln in text.splitlines() if ln.startswith("| `--")]
    listed = set(megatron_compat.NO_EFFECT) | set(megatron_compat.UNSUPPORTED)
    in_table = {f for row in rows for f in FLAG.findall(row.split("|")[1])}
    assert listed <= in_table, f"add to docs/from-megatron.md's flags table: {sorted(listed - in_table)}"
    for row in rows:
        if row.split("|")[2].strip().startswith("refused"):
            for flag in FLAG.findall(row.split("|")[1])[:1]:  # the refused flag; others name the condition
                assert flag in megatron_compat.UNSUPPORTED, f"{flag} is no longer refused: update its row"


def test_slug_matches_mkdocs():
    assert slug("Hierarchical reduction (multi-node)") == "hierarchical-reduction-multi-node"
    assert slug("Memory: sharding strategies") == "memory-sharding-strategies"
    assert slug("`--foo` and the bar") == "-foo-and-the-bar"
    assert slug("megatron_compat") == "megatron_compat"


def test_readme_is_short_and_keeps_its_commands():
    lines = _text(REPO / "README.md").splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; it must stay under 200: move detail to docs/"
    test_command = "bash tools/install.sh && python3 -m pytest -q tests"
    assert lines[3].startswith("bash examples/quickstart.sh ")
    assert lines[4].startswith(test_command + " ")
    assert test_command in _text(REPO / ".ci" / "run").splitlines(), "CI must run the README's test command"


def test_pages_open_with_a_command():
    for page in sorted((REPO / "docs").rglob("*.md")):
        lines = [ln for ln in _text(page).splitlines() if ln.strip()]
        opening = [ln.startswith("```") for ln in lines[1:6]]
        assert lines[0].startswith("# ") and any(opening), f"{page.name} must open with a command (a code block)"


def test_flag_reference_is_current():
    current = (REPO / PAGE).read_text(encoding="utf-8") if (REPO / PAGE).exists() else ""
    assert current == render(), f"{PAGE} is out of date: run `{COMMAND}` and commit it"


# --- the checks catch what they are for ---------------------------------------------------------


def _site(tmp_path: Path, body: str) -> list:
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "real.py").write_text("")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n## Real heading\n")
    page = docs / "page.md"
    page.write_text(f"# Page\n\n{body}\n")
    return [page]


@pytest.mark.parametrize(
    "body, found",
    [
        ("[x](no_such_page.md)", "no_such_page.md (no such file)"),
        ("[x](index.md#no-such-heading)", "index.md#no-such-heading (no heading"),
        ("[x](#nowhere)", "#nowhere (no heading"),
    ],
)
def test_link_check_catches(tmp_path, body, found):
    pages = _site(tmp_path, body + " and [ok](index.md#real-heading), `[code](not_a_link.md)`")
    assert [p for p in link_problems(pages, tmp_path) if found in p] and len(link_problems(pages, tmp_path)) == 1


@pytest.mark.parametrize(
    "body, found",
    [
        ("```bash\npython3 tools/missing.py --x 1\n```", "tools/missing.py does not exist"),
        ("```bash\nbash run_me.sh\n```", "run_me.sh does not exist"),
    ],
)
def test_file_check_catches(tmp_path, body, found):
    pages = _site(tmp_path, body + "\n\n```bash\npython3 tools/real.py --out corpus.jsonl /tmp/x\n```")
    assert file_problems(pages, tmp_path) == [f"docs/page.md: {found}"]


def test_flag_check_catches(tmp_path):
    pages = _site(
        tmp_path,
        "Use `--tensor-model-parallel-size 2` and `--no-such-flag`.\n\n"
        "`--use-mcore-models` is accepted.\n\n`--use-mcore-models` is accepted and has no effect.",
    )
    assert flag_problems(pages, tmp_path) == [
        "docs/page.md: --no-such-flag is accepted by no parser",
        "docs/page.md: --use-mcore-models is ignored or refused: say so in '`--use-mcore-models` is accepted.'",
    ]


def test_every_page_is_in_the_site_nav():
    nav = set(re.findall(r"^\s+- [^:\n]+: (\S+\.md)\s*$", _text(REPO / "mkdocs.yml"), re.M))
    pages = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert not pages - nav, f"add to nav in mkdocs.yml: {sorted(pages - nav)}"
    assert not nav - pages, f"nav names missing pages: {sorted(nav - pages)}"
