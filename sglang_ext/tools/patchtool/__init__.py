"""Patch-series tooling behind ``python -m sglang_ext patches`` (CLI in ``sglang_ext.tools.patches``).

Modules, one job each:

- ``git``      run git (the only tool that touches patches or trees) and report its errors.
- ``series``   read a series folder: ``series``, ``base.toml`` and the hunks of each diff.
- ``wheel``    fetch a pinned SGLang wheel, verify it, turn its sources into a git checkout.
- ``tree``     what a series is applied to: a checkout, site-packages, or a git ref.
- ``check``    check / apply a series (all or nothing, "already applied", partial state).
- ``history``  series <-> commits: import (git am), export (git format-patch), rebase.
- ``report``   the table and JSON printed by the CLI.
"""
