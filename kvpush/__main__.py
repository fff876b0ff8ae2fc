"""``python -m kvpush``: the same as the ``kvpush`` command."""

import sys

from .cli import main

sys.exit(main())
