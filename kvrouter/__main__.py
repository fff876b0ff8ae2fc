"""``python -m kvrouter ...``: the router (the flags of ``kvpush proxy``)."""

import sys

from .cli import main

sys.exit(main())
