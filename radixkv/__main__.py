"""``python -m radixkv``: the ``radixkv`` command line (radixkv/cli.py)."""

from radixkv.cli import main

raise SystemExit(main())
