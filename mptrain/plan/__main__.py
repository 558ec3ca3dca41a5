"""`python -m mptrain.plan`: the command line of the package (its doc says what it prints)."""

import sys

from mptrain.plan import main

sys.exit(main())
