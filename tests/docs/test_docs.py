"""The documentation site (`docs/`, MkDocs): it builds without a warning, its API page lists
every public name, every image its pages show exists, and every Python snippet on its pages
runs."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = os.path.join(ROOT, "docs")
# A snippet that cannot run here says why and which test runs its code, on the line before.
NOT_RUN = re.compile(r"<!-- not run: (?P<why>.*?) -->\s*$")
FENCE = re.compile(r"^(?P<indent>[ ]*)```python\n(?P<code>.*?)^(?P=indent)```", re.S | re.M)


def _pages():
    for folder, _, files in os.walk(DOCS):
        for name in sorted(files):
            if name.endswith(".md"):
                yield os.path.relpath(os.path.join(folder, name), DOCS)


def snippets(page):
    """[(line, code, why-not-run or None)] of `page`'s Python blocks, in order."""
    text = open(os.path.join(DOCS, page)).read()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(before)
        found.append((text[:match.start()].count("\n") + 1,
                      textwrap.dedent(match.group("code")), skip and skip["why"]))
    return found


PAGES_WITH_CODE = [p for p in _pages() if any(why is None for _, _, why in snippets(p))]


@pytest.mark.slow
@pytest.mark.one_process
def test_the_site_builds_without_a_warning(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert os.path.exists(tmp_path / "api" / "index.html")


def test_the_api_page_lists_every_public_name():
    import tfpar

    text = open(os.path.join(DOCS, "api.md")).read()
    listed = set(re.findall(r"^## `tfpar\.(\w+)`", text, re.M))
    assert listed == set(tfpar._EXPORTS), set(tfpar._EXPORTS) ^ listed


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")


def test_every_image_a_page_shows_exists():
    """(`mkdocs build --strict` fails on a missing one too, but only in the slow test.)"""
    missing = [f"{page}: {target}" for page in _pages()
               for target in IMAGE.findall(open(os.path.join(DOCS, page)).read())
               if not target.startswith(("http://", "https://"))
               and not os.path.exists(os.path.join(DOCS, os.path.dirname(page), target))]
    assert not missing, missing


def test_a_snippet_not_run_names_the_test_that_runs_its_code():
    for page in _pages():
        for line, _, why in snippets(page):
            if why is not None:
                paths = re.findall(r"tests/[\w/]+\.py", why)
                assert paths and all(os.path.exists(os.path.join(ROOT, p)) for p in paths), \
                    f"{page}:{line}: {why}"


@pytest.mark.slow
@pytest.mark.one_process
@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_every_snippet_of_a_page_runs(page, tmp_path):
    """A page's snippets run in order in one fresh process (each page starts TensorFlow
    afresh: its logical CPUs are its own), in a scratch directory."""
    code = "\n\n".join(code for _, code, why in snippets(page) if why is None)
    script = tmp_path / "snippets.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, f"{page}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
