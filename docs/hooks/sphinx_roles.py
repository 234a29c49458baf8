"""A griffe extension for the API reference: Sphinx roles in docstrings (``:func:`~pkg.name```) as code.

The package's docstrings cross-reference with Sphinx roles, which Markdown would show literally.
Each becomes inline code of the name, the last component only where the role's target starts
with ``~``, as Sphinx shows it.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _as_code(match: re.Match) -> str:
    target = match[2].split(".")[-1] if match[1] else match[2]
    return f"`{target}`"


class SphinxRolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_as_code, obj.docstring.value)
