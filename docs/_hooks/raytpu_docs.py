"""MkDocs hooks that keep the documentation honest about the code (``mkdocs build --strict``).

- Every ``::: module.Class`` directive is checked: each parameter of ``Class.__init__`` must be
  documented, either by a ``:param name:`` line in the class docstring (mkdocstrings renders those)
  or by a table row ``| `name` |`` on the page itself; and every ``:param name:`` must be a real
  parameter. A gap is a warning, so the strict build fails instead of the docs drifting.
- Every public ``*Operator`` / ``*Sensor`` class of ``airflow_provider_raytpu.operators`` and
  ``.sensors`` must be rendered on some page.
- Sphinx roles in docstrings (``:class:`~a.b.C```) are shown as plain code (``C``): mkdocstrings
  renders docstrings as Markdown, where a role would otherwise print literally.
- A relative link to a repository file outside ``docs/`` (``[x](../benchmarks/README.md)``, which
  works on GitHub) cannot be served by the site: it is shown as its text instead. A link to a file
  that does not exist is a warning.
- Defaults that name a module constant (``DEFAULT_CONN_ID``, ``DEFAULT_IMAGE``) are shown with
  the constant's value, read from the source.

The code is read with ``ast`` (nothing is imported), so the build needs neither Airflow nor Ray.
"""

from __future__ import annotations

import ast
import logging
import re
from html import escape
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.raytpu_docs")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "airflow_provider_raytpu"
RENDERED_PACKAGES = ("operators", "sensors")
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)
_PARAM = re.compile(r"^\s*:param\s+(?:[^:\s]+\s+)?(\w+)\s*:", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj):<code>~?([^<]*)</code>")

# Constants used as parameter defaults: name -> the module that defines them.
_CONSTANTS = {
    "DEFAULT_CONN_ID": "airflow_provider_raytpu.connection",
    "DEFAULT_IMAGE": "airflow_provider_raytpu.manifests.options",
}

_rendered: set[str] = set()
_LINK = re.compile(r"\[([^\]\n]+)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _constant(name: str, module: str) -> str:
    path = _module_file(module)
    for node in ast.parse(path.read_text()).body if path else ():
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                and isinstance(node.value, ast.Constant)):
            return repr(node.value.value)
    log.warning("constant %s not found in %s", name, module)
    return name


def _module_file(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _find_class(dotted: str) -> tuple[ast.ClassDef, Path] | None:
    module, _, name = dotted.rpartition(".")
    path = _module_file(module)
    if path is None:
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, path
    return None


def _init_parameters(cls: ast.ClassDef) -> list[str] | None:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args
            names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
            return [n for n in names if n != "self"]
    return None


def _table_rows(markdown: str) -> set[str]:
    return set(re.findall(r"^\|\s*`(\w+)`\s*\|", markdown, re.MULTILINE))


def _unlink_outside_docs(markdown: str, page: Any, config: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_uri).parent

    def replace(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)  # a URL, an anchor or a site-absolute path: mkdocs validates those
        path = (page_dir / target.split("#", 1)[0]).resolve()
        if path == docs_dir or docs_dir in path.parents:
            return match.group(0)  # inside docs/: mkdocs validates it
        if not path.exists():
            log.warning("%s: link %r points outside docs/ to a file that does not exist", page.file.src_uri, target)
        return text

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line):
            fenced = not fenced
        out.append(line if fenced else _LINK.sub(replace, line))
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = _unlink_outside_docs(markdown, page, config)
    rows = _table_rows(markdown)
    for dotted in _DIRECTIVE.findall(markdown):
        _rendered.add(dotted)
        found = _find_class(dotted)
        if found is None:
            continue  # a function or module: mkdocstrings itself fails on a wrong path
        cls, path = found
        parameters = _init_parameters(cls)
        if parameters is None:
            continue
        documented = set(_PARAM.findall(ast.get_docstring(cls) or ""))
        where = f"{page.file.src_uri}: {dotted}"
        for name in parameters:
            if name not in documented and name not in rows:
                log.warning("%s: parameter %r is documented neither in the docstring (:param %s:) nor in a "
                            "table row | `%s` | on the page", where, name, name, name)
        for name in sorted(documented - set(parameters) - {"kwargs"}):
            log.warning("%s: the docstring documents %r, which %s.__init__ (%s) does not take",
                        where, name, cls.name, path.relative_to(ROOT))
    return markdown


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return _ROLE.sub(lambda m: f"<code>{m.group(1).rsplit('.', 1)[-1]}</code>", html)


def on_post_page(html: str, page: Any, config: Any) -> str:
    # After autorefs has turned its placeholders into <span title="..."> / links.
    for name, module in _CONSTANTS.items():
        default = re.compile(rf'<code>(?:<span title="[\w.]*\b{name}">)?{name}(?:</span>)?</code>')
        in_signature = f'<span class="n">{name}</span>'
        if default.search(html) or in_signature in html:
            value = escape(_constant(name, module))
            html = default.sub(f"<code>{value}</code>", html)
            html = html.replace(in_signature, f'<span class="s2">{value}</span>')
    return html


def on_post_build(config: Any) -> None:
    for package in RENDERED_PACKAGES:
        for path in sorted((ROOT / PACKAGE / package).glob("*.py")):
            module = f"{PACKAGE}.{package}.{path.stem}"
            for node in ast.parse(path.read_text()).body:
                if (isinstance(node, ast.ClassDef) and not node.name.startswith("_")
                        and node.name.endswith(("Operator", "Sensor"))
                        and f"{module}.{node.name}" not in _rendered):
                    log.warning("%s.%s is rendered on no page: add a ::: directive for it", module, node.name)
    _rendered.clear()
