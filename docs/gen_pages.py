"""Build-time pages of the docs site (run by the ``gen-files`` plugin of ``mkdocs.yml``; writes nothing to the tree).

* ``estimators/<name>.md``, ``schedulers/<name>.md`` and ``terms/<name>.md``: one page per registered estimator,
  scheduler and auxiliary training term (``tables.KINDS``), from the registry record (its formula, i.e. the module's
  ``FORMULA`` constant; the ``agentcredit describe NAME`` text; the parameter declarations) plus the hand-written
  notes in ``docs/methods/<kind>/<name>.md``; ``estimators/index.md`` and ``schedulers/index.md`` hold the tables
  that README.md shows (``terms/index.md`` the terms' table), and ``SUMMARY.md`` in each folder is its navigation
  (``literate-nav``).
* ``img/*.png``: the benchmark plots of ``benchmarks/results/``, so the pages can show them.
"""

import glob
import os
import sys

import mkdocs_gen_files

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tables  # noqa: E402

for kind in tables.KINDS:
    names = [name for name, _, _ in tables.items(kind)]
    with mkdocs_gen_files.open(f"{kind}/index.md", "w") as f:
        f.write(tables.index_page(kind))
    for name in names:
        with mkdocs_gen_files.open(f"{kind}/{name}.md", "w") as f:
            f.write(tables.method_page(kind, name))
    with mkdocs_gen_files.open(f"{kind}/SUMMARY.md", "w") as f:
        f.write("* [Overview](index.md)\n" + "".join(f"* [`{n}`]({n}.md)\n" for n in names))

for png in sorted(glob.glob(os.path.join(tables.ROOT, "benchmarks", "results", "*.png"))):
    with open(png, "rb") as src, mkdocs_gen_files.open(f"img/{os.path.basename(png)}", "wb") as dst:
        dst.write(src.read())
