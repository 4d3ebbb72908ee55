#!/usr/bin/env python
"""Check that every ``# Copied from depthfusion_hf....`` copy in src/ matches its original; ``--fix`` rewrites
drifted copies from their originals, ``--diff`` shows what differs. Exit status 1 when a problem is left.

    python scripts/check_copies.py            # list drifted copies
    python scripts/check_copies.py --fix      # rewrite them

The logic lives in ``depthfusion_hf.check_copies`` (standard library only).
"""

from __future__ import annotations

from depthfusion_hf.check_copies import main

if __name__ == "__main__":
    raise SystemExit(main())
