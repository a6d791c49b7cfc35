"""Every specification reference in the repository resolves to a page and an anchor inside the repository.

The method specifications live in ``docs/specs/credit.md`` and ``docs/specs/distill.md``. Code, tests and docs cite
them in a short form: ``spec credit §4.2`` (a section, anchor ``#s4-2``), ``spec credit T4.1`` (a test item, anchor
``#t4-1``), ``spec credit X7`` (a cross-method invariant, ``#x7``), ``spec distill E4`` / ``spec distill P2``
(an estimator / a combination pattern, ``#e4`` / ``#p2``). A list continues a reference: ``spec credit §8.1-8.5,
§15.6, T8.1-T8.8``. A bare ``§N`` elsewhere must be a paper's section (its line names the paper: arXiv, Eq., Alg.,
"paper", ...); a bare test-item id ``T4.1`` must exist on the credit page. Repository paths ``docs/....md#anchor``
must exist too. The specification files these pages were written from are outside the repository and must not be
cited.
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = {"credit": "docs/specs/credit.md", "distill": "docs/specs/distill.md"}
SKIP_DIRS = {".venv", "site", ".git", "node_modules", "__pycache__", "agentcredit.egg-info"}
EXTENSIONS = (".py", ".md", ".yaml", ".yml", ".toml")
EXTRA_FILES = (".ci/run",)
THIS = os.path.relpath(os.path.abspath(__file__), ROOT)

# names of the outside inputs, assembled so that this file does not cite them itself
_OUTSIDE = ["CREDIT" + ".md", "DISTILL" + ".md", "ARCHITECTURE" + ".md", "STYLE" + ".md", "CREDIT_QUALITY" + ".md",
            "shared/" + "specs", "shared/" + "design", "shared/" + "research", "CREDIT" + " §", "DISTILL" + " §"]
OUTSIDE = re.compile("|".join(re.escape(n) for n in _OUTSIDE))

_ID = r"(?:§\s?\d+(?:\.\d+)*|[TXEP]\d+(?:\.\d+)?)"
_RANGE = rf"{_ID}(?:\s?[-–]\s?(?:§|[TXEP])?\d+(?:\.\d+)*)?"
_SEP = r"(?:\s*(?:,|;|/|\band\b|:)\s*|\s+)"
EXPLICIT = re.compile(rf"\bspec\s+(credit|distill)\s+({_RANGE}(?:{_SEP}{_RANGE})*)", re.IGNORECASE)
ONE = re.compile(rf"(§|[TXEP])\s?(\d+(?:\.\d+)*)(?:\s?[-–]\s?(§|[TXEP])?(\d+(?:\.\d+)*))?")
BARE_SECTION = re.compile(r"§\s?\d")
BARE_ITEM = re.compile(r"(?<![\w.])T\d+\.\d+(?![\w.])")
PAPER_LINE = re.compile(r"arXiv|\bEqs?\.|\bAlg\.|\bApp\.|paper|AT²PO §|Table \d", re.IGNORECASE)
PATH_REF = re.compile(r"\bdocs/[\w./-]+?\.md(?:#[\w-]+)?")
SPEC_LINK = re.compile(r"\]\(((?:\.\./)*(?:docs/)?specs/(credit|distill)\.md)#([\w-]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*(?:\{#([\w-]+)\})?\s*$")
HTML_ID = re.compile(r"<a\s+id=\"([\w-]+)\"")


def _slug(title: str) -> str:
    """Python-Markdown's default heading slug: lower case, punctuation dropped, spaces to hyphens."""
    title = re.sub(r"[`*_]", "", title)
    title = re.sub(r"[^\w\s-]", "", title).strip().lower()
    return re.sub(r"[-\s]+", "-", title)


def anchors(text: str) -> set[str]:
    """The anchors a markdown page defines: ``{#id}`` on headings (else the heading's slug) and ``<a id="...">``."""
    found = set(HTML_ID.findall(text))
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else HEADING.match(line)
        if m:
            found.add(m.group(2) or _slug(m.group(1)))
    return found


def anchor_of(kind: str, number: str) -> str:
    return ("s" if kind == "§" else kind.lower()) + number.replace(".", "-")


def _ids(ref: str) -> list[str]:
    """The anchors one reference list names: both ends of every range."""
    out = []
    for m in ONE.finditer(ref):
        kind, first, kind2, last = m.groups()
        out.append(anchor_of(kind, first))
        if last is not None:
            out.append(anchor_of(kind2 or kind, last))
    return out


def problems(text: str, path: str, pages: dict[str, set[str]], exists=None) -> list[str]:
    """Every reference of ``text`` (the file at ``path``) that does not resolve, as ``path:line: why``."""
    exists = exists or (lambda p: os.path.exists(os.path.join(ROOT, p)))
    out = []
    in_spec_page = path in PAGES.values()          # its own [§N](#sN) links are checked by mkdocs --strict
    prev = ""
    for no, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{no}"
        for m in OUTSIDE.finditer(line):
            out.append(f"{where}: cites {m.group(0)!r}, a file outside the repository; cite docs/specs/ instead")
        consumed = []
        for m in EXPLICIT.finditer(line):
            page = m.group(1).lower()
            consumed.append(m.span())
            for anchor in _ids(m.group(2)):
                if anchor not in pages[page]:
                    out.append(f"{where}: 'spec {page}' has no #{anchor} ({PAGES[page]})")
        for m in SPEC_LINK.finditer(line):
            if m.group(3) not in pages[m.group(2)]:
                out.append(f"{where}: link {m.group(1)}#{m.group(3)}: no such anchor")

        def free(pos):
            return not any(a <= pos < b for a, b in consumed)

        line_pages = {m.group(1).lower() for m in EXPLICIT.finditer(line)}
        if not in_spec_page and not PAPER_LINE.search(prev + line):
            for m in BARE_SECTION.finditer(line):
                if not free(m.start()):
                    continue
                if len(line_pages) == 1:            # "spec distill §8.2 M1, §8.3 M2": the line's page
                    page = next(iter(line_pages))
                    number = re.match(r"§\s?(\d+(?:\.\d+)*)", line[m.start():]).group(1)
                    if anchor_of("§", number) not in pages[page]:
                        out.append(f"{where}: 'spec {page}' (this line's page) has no #{anchor_of('§', number)}")
                else:
                    out.append(f"{where}: bare {line[m.start():m.start() + 6]!r}: write 'spec credit §N' or "
                               "'spec distill §N' (or name the paper on the line)")
        for m in BARE_ITEM.finditer(line):
            if free(m.start()) and anchor_of("T", m.group(0)[1:]) not in pages["credit"]:
                out.append(f"{where}: test item {m.group(0)} is not in {PAGES['credit']}")
        for m in PATH_REF.finditer(line):
            ref = m.group(0)
            file, _, anchor = ref.partition("#")
            if not exists(file):
                out.append(f"{where}: {file} does not exist")
            elif anchor and file.endswith(".md"):
                with open(os.path.join(ROOT, file), encoding="utf-8") as fh:
                    if anchor not in anchors(fh.read()):
                        out.append(f"{where}: {file} has no #{anchor}")
        prev = line
    return out


def _pages() -> dict[str, set[str]]:
    pages = {}
    for name, rel in PAGES.items():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
            pages[name] = anchors(fh.read())
    return pages


def _files():
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv"))  # .venv-vllm too
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(folder, f), ROOT)
            if (f.endswith(EXTENSIONS) or rel in EXTRA_FILES) and rel != THIS:
                yield rel


def test_spec_pages_exist_with_section_and_item_anchors():
    pages = _pages()
    assert {"s1-5", "s2", "t2-4", "s4-2", "t5-9", "x7", "x13", "s15-7"} <= pages["credit"]
    assert {"s2-2", "e1", "e7", "p2", "s7-2", "s11-2", "s14-6"} <= pages["distill"]


def test_every_spec_reference_in_the_repository_resolves():
    pages = _pages()
    found, bad = 0, []
    for rel in _files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
            text = fh.read()
        found += len(EXPLICIT.findall(text))
        bad += problems(text, rel, pages)
    assert found > 50, f"only {found} spec references found: is the pattern still the one the code uses?"
    assert not bad, "\n".join(bad)


PAGES_FAKE = {"credit": {"s4", "s4-2", "s8-1", "s8-5", "t4-1", "x7", "x13"}, "distill": {"s7", "e4", "p2"}}


@pytest.mark.parametrize("line", [
    "see spec credit §4.3",                     # no such section
    "spec credit T4.9",                         # no such item
    "(spec credit §4.2, §9)",                   # the second of a list
    "spec credit §8.1-8.6",                     # the end of a range
    "spec distill E8",
    "spec credit X14",
    "Spec: " + "CREDIT" + ".md §4.2",           # the outside file
    "shared/" + "specs/" + "DISTILL" + ".md",
    "the estimator follows §4.2 of the spec",   # bare section, no paper named
    "spec credit §4.2 steps 1-3, §4.7",         # a later bare section of the line's page that does not exist
    "# T4.7: ordering",                         # bare item id that does not exist
    "docs/specs/credit.md#s99",                 # path with a missing anchor
    "docs/nowhere.md",                          # path that does not exist
    "[spec](../specs/credit.md#t9-9)",          # markdown link with a missing anchor
])
def test_the_check_rejects_a_bad_reference(line):
    assert problems(line, "x.py", PAGES_FAKE, exists=lambda p: p.startswith("docs/specs/"))


@pytest.mark.parametrize("line", [
    "spec credit §4.2, §8.1-8.5, T4.1, X7-X13",
    "Spec credit §4: GraphHCA",
    "spec distill §7, E4, P2",
    "(spec credit §8.1 host, §8.5 tests)",      # later bare sections of the line's page
    "arXiv:2609.35084 (§4, Alg. 1, Eqs. 1, 5)",  # a paper's section
    "# T4.1: w_s = 0 gives GRPO",
])
def test_the_check_accepts_a_good_reference(line):
    assert not problems(line, "x.py", PAGES_FAKE, exists=lambda p: True)
