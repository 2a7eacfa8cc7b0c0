"""From a source checkout: exactly ``strategies/`` and ``models/`` as ``tfdist.strategies`` and ``tfdist.models``.

An installed copy needs none of this (setuptools maps the two folders into the
package); ``tfdist/__init__.py`` installs the finder only when it runs from a
checkout. Nothing else at the repository's top can become ``tfdist.<name>``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os


class CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds ``tfdist.<folder>`` (and everything under it) for the named top-level folders only."""

    def __init__(self, root: str, folders: tuple[str, ...]):
        self.locations = {f"tfdist.{name}": os.path.join(root, name) for name in folders}

    def find_spec(self, fullname, path=None, target=None):
        location = self.locations.get(fullname)
        if location is None:
            return None  # submodules are found through the package's own __path__
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(location, "__init__.py"), submodule_search_locations=[location])
