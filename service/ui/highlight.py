"""Generated code as a page that can run nothing: escaped, highlighted, served under a CSP sandbox.

Code generated from a hostile upload is hostile too: a graph name pasted into a C++ string or a Python comment
could read `</pre><script>...`. Pygments escapes every token (`&`, `<`, `>`, `"`, `'`), and the document is served
with `Content-Security-Policy: sandbox` and no script source at all, in an `<iframe sandbox>`: even unescaped
markup would run in an opaque origin with scripts, forms, popups and navigation of the console refused.
"""

from __future__ import annotations

import base64
import hashlib
import re

from markupsafe import escape
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import CppLexer, PythonLexer, TextLexer

_FORMATTER_OPTS = {"cssclass": "code", "linenos": "inline", "lineanchors": "L", "anchorlinenos": True,
                   "wrapcode": True}
_LAYOUT = """
html { background: #fbfbfd; }
body { margin: 0; font: 12.5px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; color: #1d2433; }
.code pre { margin: 0; padding: 8px 12px; white-space: pre; }
.code .linenos { color: #9aa3b2; padding-right: 1.2em; user-select: none; }
.code a[href] { color: inherit; text-decoration: none; }
.code a[id]:target + a .linenos { background: #ffe066; color: #1d2433; font-weight: bold; }
.note { font-family: system-ui, sans-serif; padding: 10px 14px; color: #5b6475; border-bottom: 1px solid #e3e6ee; }
"""
CSS = _LAYOUT + HtmlFormatter(style="default", **_FORMATTER_OPTS).get_style_defs(".code")
# The one inline style the code page may hold (its CSP names this hash): no script source is allowed at all.
CSS_HASH = "sha256-" + base64.b64encode(hashlib.sha256(CSS.encode()).digest()).decode()
CODE_CSP = (f"default-src 'none'; style-src '{CSS_HASH}'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'self'; sandbox")

_CPP_KERNEL = re.compile(r'^\s*(?:extern\s+"C"\s+)?(?:void|__global__\s+void)\s+([A-Za-z_]\w*)\s*\(', re.M)
_PY_DEF = re.compile(r"^\s*(?:async\s+)?def\s+([A-Za-z_]\w*)\s*\(|^([A-Za-z_]\w*)\s*=\s*async_compile\.", re.M)


def lexer_for(path: str) -> Lexer:
    if path.endswith((".cpp", ".h", ".hpp", ".cu")):
        return CppLexer(stripnl=False, ensurenl=False)
    if path.endswith(".py"):
        return PythonLexer(stripnl=False, ensurenl=False)
    return TextLexer(stripnl=False, ensurenl=False)


def to_html(path: str, source: str) -> str:
    """The highlighted code, escaped token by token, lines anchored as #L-1, #L-2, ..."""
    return highlight(source, lexer_for(path), HtmlFormatter(**_FORMATTER_OPTS))


def definitions(source: str) -> dict[str, int]:
    """Kernel name -> the line defining it (C++ `extern "C" void name(`, a Triton `def name(` or
    `name = async_compile.triton(...)`), for links from the kernel table into the code view."""
    out: dict[str, int] = {}
    for rx in (_CPP_KERNEL, _PY_DEF):
        for m in rx.finditer(source):
            name = m.group(1) or (m.group(2) if m.lastindex and m.lastindex >= 2 else None)
            if name and name not in out:
                out[name] = source.count("\n", 0, m.start()) + 1
    return out


def document(title: str, body_html: str, note: str = "") -> str:
    """The code view's whole page. `body_html` is Pygments' output (every token escaped); the title and note are
    escaped here."""
    head = f'<p class="note">{escape(note)}</p>' if note else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body>{head}{body_html}</body></html>")
