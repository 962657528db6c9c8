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


def _homes() -> dict[str, set[str]]:
    """Every command or code line (fenced blocks, over 25 characters, comments cut) and every table row of the README,
    the site and cluster.yaml's header comment, by the files that hold it."""
    found: dict[str, set[str]] = {}
    cluster = (REPO / "cluster.yaml").read_text().split("\ncluster_name:")[0]
    texts = {p.relative_to(REPO).as_posix(): p.read_text() for p in [README, *sorted(DOCS.glob("*.md"))]}
    texts["cluster.yaml"] = "```\n" + "\n".join(line.lstrip("# ") for line in cluster.splitlines()) + "\n```"
    for name, text in texts.items():
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M):
            for line in block.splitlines():
                code = re.sub(r"\s+#.*$", "", line.strip())
                if len(code) > 25 and not code.startswith("#"):
                    found.setdefault(code, set()).add(name)
        for line in _prose(text).splitlines():
            if line.startswith("|") and len(line) > 40 and set(line) - set("|-: "):
                found.setdefault(line.strip(), set()).add(name)
    return found


def test_each_command_table_row_and_snippet_has_one_home():
    """The README points into docs/, the docs pages point to each other: a command, a table row or a snippet written
    in two places is one that goes stale in one of them (as the README's and the docs' copies of the install steps,
    the cluster commands and the rayvl.load lines did)."""
    twice = {line: sorted(names) for line, names in _homes().items() if len(names) > 1}
    assert not twice, "\n".join(f"{names}: {line[:100]}" for line, names in sorted(twice.items()))
