"""Pieces of the report page (ddpdoctor/render/html_report.py) that its tests read: a fixture, a chart's block,
the page without its scripts' code. Shared by tests/unit/test_html_report.py and tests/viewers/."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def outside_scripts(text: str) -> str:
    """The page less its inline scripts' code (plotly.js holds URLs as strings it never fetches here)."""
    return re.sub(r"(<script\b[^>]*>).*?(</script>)", r"\1\2", text, flags=re.DOTALL | re.IGNORECASE)


def block(text: str, key: str) -> str:
    """One chart's part of the page: from its block to the next block or the footer."""
    start = text.index(f'id="block-{key}"')
    ends = [i for i in (text.find('id="block-', start + 1), text.find("<footer", start)) if i > 0]
    return text[start:min(ends)]
