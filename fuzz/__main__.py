"""``python -m fuzz ...`` runs the campaign (see :mod:`fuzz.campaign`)."""

import sys

from fuzz.campaign import main

sys.exit(main())
