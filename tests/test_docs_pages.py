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


def _layer_section_listing(text: str) -> dict[str, list[str]]:
    """Each ``x.py`` path named in docs/architecture.md's "## Layers" section -> the layer
    headings it is named under (``### <layer>``, ``#### fsdp: <layer>`` for the engine's)."""
    section = text[text.index("## Layers"):]
    section = section[:section.index("\n## ", 1)]
    where, heading = {}, None
    for line in section.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
        elif line.startswith("#### fsdp: "):
            heading = "fsdp/" + line[len("#### fsdp: "):].strip()
        for path in re.findall(r"`([\w/]+\.py)`", line):
            if path.startswith("tests/"):
                continue
            where.setdefault(path, []).append(heading)
    return where


def _declared_layer(path: str) -> str:
    from _layers import describe

    return describe(".".join(["ragged_fsdp", *path.removesuffix(".py").split("/")]).removesuffix(".__init__"))


def test_architecture_names_every_module_in_its_layer():
    """docs/architecture.md's layer section names every module under src/ragged_fsdp/, each
    under the layer tests/_layers.py declares for it, and its headings and diagram give the
    layers in the declared order."""
    from _layers import FSDP_LAYERS, LAYERS

    text = (DOCS / "architecture.md").read_text()
    heads = re.findall(r"^### (\S+)$", text[text.index("## Layers"):text.index("## The engine's objects")], re.M)
    subs = re.findall(r"^#### fsdp: (\S+)$", text, re.M)
    assert heads == [n for n, _ in LAYERS] and subs == [n for n, _ in FSDP_LAYERS], (
        f"docs/architecture.md's layer headings {heads} / {subs} differ from tests/_layers.py's order")
    diagram = text[text.index("```text", text.index("## Layers")) + 7:]
    diagram = diagram[:diagram.index("```")].strip().splitlines()
    assert [line.split()[0].rstrip(",") for line in diagram] == [n for n, _ in reversed(LAYERS)], (
        "docs/architecture.md's layer diagram (top first) differs from tests/_layers.py's order")
    fsdp_line = next(line for line in diagram if line.startswith("fsdp "))
    assert fsdp_line.split(None, 1)[1].split(" > ") == [n for n, _ in reversed(FSDP_LAYERS)], fsdp_line
    src = ROOT / "src/ragged_fsdp"
    files = sorted(str(p.relative_to(src)) for p in src.rglob("*.py"))
    named = _layer_section_listing(text)
    missing = [f for f in files if f not in named]
    assert not missing, f"modules not named in docs/architecture.md's layers: {missing}"
    gone = sorted(set(named) - set(files))
    assert not gone, f"docs/architecture.md's layers name modules that do not exist: {gone}"
    wrong = [(f, named[f], _declared_layer(f)) for f in files if set(named[f]) != {_declared_layer(f)}]
    assert not wrong, "named under the wrong layer (file, where, declared): " + repr(wrong)


def test_the_architecture_check_can_fail():
    text = "## Layers\n### pure\n`shapes.py` and `fsdp/api.py`\n#### fsdp: core\n`fsdp/core/unit.py`\n## Next\n"
    named = _layer_section_listing(text)
    assert named == {"shapes.py": ["pure"], "fsdp/api.py": ["pure"], "fsdp/core/unit.py": ["fsdp/core"]}
    assert _declared_layer("fsdp/api.py") == "fsdp/api" and _declared_layer("shapes.py") == "pure"
    assert _declared_layer("fsdp/core/unit.py") == "fsdp/core" and _declared_layer("fsdp/__init__.py") == "fsdp/api"


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
    neither links is a page nobody finds."""
    pages = _guide_pages()
    assert "gradient-reduce.md" in pages and len(pages) > 10
    readme, index = (ROOT / "README.md").read_text(), (DOCS / "index.md").read_text()
    missing = [(p, where) for p in pages for where, text, link in
               (("README.md", readme, f"(docs/{p}"), ("docs/index.md", index, f"({p}")) if link not in text]
    assert not missing, f"guide pages not linked: {missing}"
