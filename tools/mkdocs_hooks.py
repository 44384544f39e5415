"""mkdocs hooks (mkdocs.yml `hooks:`): publish the benchmark plots with the site.

The pages link plots by their repository path (`../bench/results/x.svg`), which works on GitHub; the site has
no `..`, so the plots are added to it as `bench/results/x.svg` and the pages' links rewritten to match."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

_REPO = Path(__file__).resolve().parent.parent
_RESULTS = "bench/results"


def on_files(files, config):
    for path in sorted((_REPO / _RESULTS).glob("*")):
        if path.suffix in (".svg", ".png"):
            files.append(File.generated(config, f"{_RESULTS}/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")
    return markdown.replace(f"]({'../' * (depth + 1)}{_RESULTS}/", f"]({'../' * depth}{_RESULTS}/")
