"""The docs stay true to the code: tables match their JSON, every package has an API page,
every error class the library defines is explained on the troubleshooting page."""

import ast
import re
from pathlib import Path

import pytest

import _benchmarks  # noqa: F401  (benchmarks/ on sys.path)
import render

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_match_their_json(page):
    text = page.read_text()
    assert render.render_page(text, page) == text, (
        f"{page.relative_to(ROOT)}: a table differs from its JSON; run "
        f"python benchmarks/render.py {page.relative_to(ROOT)}")


def test_every_package_has_an_api_page():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: (ragged_fsdp[\w.]*)", page.read_text(), re.M))
    packages = {"ragged_fsdp." + p.parent.name for p in (ROOT / "src/ragged_fsdp").glob("*/__init__.py")}
    packages -= {"ragged_fsdp.cli"}  # commands, documented by --help and the guide pages
    missing = sorted(p for p in packages if not any(d == p or d.startswith(p + ".") for d in documented))
    assert not missing, f"no ::: directive in docs/api/ for {missing}"


def test_every_error_class_is_on_the_troubleshooting_page():
    page = (DOCS / "troubleshooting.md").read_text()
    classes = set()
    for f in (ROOT / "src/ragged_fsdp").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error") and not node.name.startswith("_"):
                classes.add(node.name)
    missing = sorted(c for c in classes if f"`{c}`" not in page)
    assert not missing, f"docs/troubleshooting.md does not explain {missing}"


def test_render_fills_a_table(tmp_path):
    (tmp_path / "r.json").write_text('{"meta": {"command": "python -m x", "date": "d", "torch": "t", '
                                     '"cpu_cores": 2, "gpu": "none"}, "rows": [{"a": 0.5, "b": {"c": 2}}, {"a": 2}]}')
    page = tmp_path / "p.md"
    page.write_text("<!-- bench: r.json rows=rows\n| A | C | ratio |\n| {a:pct} | {b.c:int} | {a/b.c:.2f} |\n-->\nold\n<!-- /bench -->\n")
    out = render.render_page(page.read_text(), page)
    assert "| 50.00% | 2 | 0.25 |" in out and "| 200.00% | - | - |" in out and "old" not in out
    assert "`python -m x`" in out and "2 CPU cores" in out
    assert render.render_page(out, page) == out  # rendering is idempotent


def test_render_refuses_json_without_meta(tmp_path):
    (tmp_path / "r.json").write_text('{"rows": []}')
    page = tmp_path / "p.md"
    page.write_text("<!-- bench: r.json rows=rows\n| A |\n| {a} |\n-->\n<!-- /bench -->\n")
    with pytest.raises(render.RenderError, match="meta"):
        render.render_page(page.read_text(), page)


def test_readme_links_resolve():
    """The README is read on the forge, outside the site build: its relative links must exist."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [l for l in links if "://" not in l and not (ROOT / l).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_plan_out_writes_meta_and_cells(tmp_path, capsys):
    from ragged_fsdp.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama3-8b", "--world", "64", "--granularity", "row", "--out", str(out)]) == 0
    data = __import__("json").loads(out.read_text())
    assert set(data["meta"]) >= {"command", "date", "torch", "cpu_cores", "gpu"}
    assert [c["model"] for c in data["cells"]] == ["llama3-8b"]


def test_render_optional_block_without_json(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("<!-- bench: gone.json rows=rows optional\n| A |\n| {a} |\n-->\n<!-- /bench -->\n")
    assert "Not measured yet" in render.render_page(page.read_text(), page)
    page.write_text(page.read_text().replace(" optional", ""))
    with pytest.raises(render.RenderError, match="does not exist"):
        render.render_page(page.read_text(), page)


def test_the_engine_table_lists_every_file_once():
    """docs/architecture.md's table of ragged_fsdp/fsdp/ names each file of the tree once (the
    sub-packages' __init__.py, docstrings only, are described above the table)."""
    text = (DOCS / "architecture.md").read_text()
    table = text[text.index("## The engine's objects"):text.index("## One step")]
    rows = re.findall(r"^\| `([\w/]+\.py)` \|", table, re.M)
    engine = ROOT / "src/ragged_fsdp/fsdp"
    files = sorted(str(p.relative_to(engine)) for p in engine.rglob("*.py")
                   if not (p.name == "__init__.py" and p.parent != engine))
    assert len(rows) == len(set(rows)), f"listed twice: {sorted({r for r in rows if rows.count(r) > 1})}"
    assert sorted(rows) == files, f"missing: {sorted(set(files) - set(rows))}, not in the tree: {sorted(set(rows) - set(files))}"


def _guide_pages() -> list[str]:
    """The pages under the site's "User guide" section of mkdocs.yml's nav."""
    lines = (ROOT / "mkdocs.yml").read_text().splitlines()
    start = lines.index("  - User guide:")
    pages = []
    for line in lines[start + 1:]:
        if not line.startswith("      - "):
            break
        pages.append(line.rsplit(":", 1)[1].strip())
    return pages


def test_every_guide_page_is_linked_from_readme_and_index():
    """A user reads the README or the site's home page, not mkdocs.yml: a guide page
    neither links is a page nobody finds (docs/gradient-reduce.md was one)."""
    pages = _guide_pages()
    assert "gradient-reduce.md" in pages and len(pages) > 10
    readme, index = (ROOT / "README.md").read_text(), (DOCS / "index.md").read_text()
    missing = [(p, where) for p in pages for where, text, link in
               (("README.md", readme, f"(docs/{p}"), ("docs/index.md", index, f"({p}")) if link not in text]
    assert not missing, f"guide pages not linked: {missing}"
