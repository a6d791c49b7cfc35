"""The docs promise: README.md's tables are the registry's, README.md is short and links into docs pages that exist,
and every registered estimator and scheduler gets a page with the text ``agentcredit describe`` prints.
(``mkdocs build --strict`` itself runs in .ci/run: broken links and missing pages fail there.)"""

import dataclasses
import importlib.util
import os
import re

import pytest
import yaml

from credit_plugins import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tables():
    spec = importlib.util.spec_from_file_location("agentcredit_docs_tables", os.path.join(ROOT, "docs", "tables.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_readme_tables_are_the_registry_tables():
    tables, readme = _tables(), read("README.md")
    for name, block in tables.readme_blocks().items():
        assert tables.readme_block(readme, name) == block, (
            f"README.md's {name} table differs from the registry; run: python docs/tables.py")
    assert tables.update_readme(readme) == readme


def test_the_tables_name_every_registered_estimator_and_scheduler():
    tables = _tables()
    for kind, table in (("estimators", tables.estimator_table()), ("schedulers", tables.scheduler_table())):
        rows = re.findall(r"^\| `([a-z0-9_]+)` \|", table, re.M)
        assert rows == registry.available(kind)


def test_readme_is_short_and_links_into_docs_pages_that_exist():
    readme = read("README.md")
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    docs = [link for link in local if link.startswith("docs/")]
    assert len(docs) >= 8, docs  # getting started, integrations, environments, benchmarks, architecture, ...
    for link in local:
        assert os.path.isfile(os.path.join(ROOT, link)), f"README.md links to {link}, which does not exist"


def _nav_files(nav):
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from _nav_files(value)
        else:
            yield value


def test_every_page_in_the_nav_exists_or_is_generated():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = yaml.load(f, Loader=yaml.BaseLoader)  # BaseLoader: mkdocs.yml may use !! tags
    generated = {f"{kind}/" for kind in _tables().KINDS}
    for page in _nav_files(config["nav"]):
        assert page in generated or os.path.isfile(os.path.join(ROOT, "docs", page)), page


@pytest.mark.parametrize("kind", ["estimators", "schedulers"])
def test_every_registered_method_gets_a_page_with_its_describe_text(kind):
    tables = _tables()
    for name, item, _ in tables.items(kind):
        page = tables.method_page(kind, name)
        assert page.startswith(f"# `{name}`")
        assert item.describe() in page  # the text `agentcredit describe NAME` prints
        for field in dataclasses.fields(item.params):
            assert f"| `{field.name}` |" in page, (name, field.name)
        note = tables.notes(kind, name)
        if note is not None:
            assert note in page


def test_hand_written_notes_belong_to_registered_methods():
    tables = _tables()
    for kind in tables.KINDS:
        folder = os.path.join(ROOT, "docs", "methods", kind)
        names = {f[:-3] for f in os.listdir(folder) if f.endswith(".md") and not f.startswith("_")}
        assert names <= set(registry.available(kind)), names - set(registry.available(kind))


def test_hand_written_docs_cite_no_spec_files_outside_the_repository():
    cited = re.compile(r"(CREDIT|DISTILL|ARCHITECTURE)(\.md| §)|shared/(specs|design)/")
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        for f in files:
            if f.endswith(".md"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    assert not cited.search(fh.read()), os.path.relpath(path, ROOT)
    assert not cited.search(read("README.md"))
