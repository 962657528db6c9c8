"""The documents: the README is a product page that starts with the two commands of a fresh machine, the docs/ site
builds with `mkdocs build --strict` (every page in the nav, every link and anchor between pages found), and every
relative link of the README and the site points to a file that exists — and, into a docs page, to an anchor the
built page has."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 320
FIRST_COMMANDS = ["make demo", "make test"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built strictly by the mkdocs of this interpreter's environment (a missing mkdocs fails here)."""
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return out


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(path: Path) -> list[tuple[Path, str]]:
    """(target file, anchor) of every relative link and image of a Markdown file."""
    out = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor of the same page
        file, _, anchor = target.partition("#")
        out.append(((path.parent / file).resolve(), anchor))
    return out


def _built_page(site: Path, page: Path) -> Path:
    """The HTML mkdocs writes for a docs page (directory URLs: docs/x.md → x/index.html)."""
    rel = page.relative_to(DOCS).with_suffix("")
    return site / ("index.html" if rel.name == "index" else rel / "index.html")


def test_the_site_builds_strictly(site):
    assert (site / "index.html").is_file() and (site / "benchmarks" / "index.html").is_file()


def test_the_readme_is_a_product_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    body = [line for line in lines[1:] if line.strip()]  # after the title
    assert lines[0].startswith("# ") and body[0].startswith("```"), body[:2]
    commands = [line.split("#")[0].strip() for line in body[1:body.index("```", 1)]]
    assert commands == FIRST_COMMANDS, commands


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_points_to_a_file_that_exists(page, site):
    links = relative_links(page)
    missing = [str(file) for file, _ in links if not file.exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"
    for file, anchor in links:
        if anchor and file.suffix == ".md" and DOCS in file.parents:  # mkdocs checks the site's own anchors too
            html = _built_page(site, file).read_text()
            assert f'id="{anchor}"' in html, f"{page.name}: {file.name} has no anchor #{anchor}"


def test_every_docs_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    assert not [p.name for p in DOCS.glob("*.md") if p.name not in nav]


def test_every_image_of_the_site_is_in_docs():
    images = [t for p in DOCS.glob("*.md") for t in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", p.read_text())]
    assert images and all((DOCS / t).is_file() and t.startswith("img/") for t in images), images
